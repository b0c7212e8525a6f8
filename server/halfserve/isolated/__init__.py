"""Engine instances in processes of their own (``execution.isolation: "process"``, ``--placement instance_processes``).

In the default thread mode an engine's instances are threads of the server process: every torch call they make lets
go of the GIL, and taking it back waits on the event loop, which holds it while it reads, decodes and answers
requests. On a GPU an instance makes dozens of such calls per batch (copies, a graph replay, a sync), so under load
its host work stretches from tens of microseconds to milliseconds while the device waits.

In process mode each instance is a process of its own, with its own interpreter, GIL, CUDA context, stream, graphs
and torch threads, running the same :class:`~halfserve.engine.core.Engine` code with one instance. The server process
keeps the batcher and sees the instances through :class:`~halfserve.isolated.engine.ProcessEngine`, which has the
engine's runner contract: a batch's rows are copied once into the instance's shared memory (a ``memfd``, page-locked in
the instance process on CUDA, so its rows go straight to the device), a small frame on a Unix socket says where they
are, and the answer comes back the same way. The event loop makes no torch call for a batch, and the instance's host
work waits for no lock the loop holds.

* :mod:`~halfserve.isolated.protocol`: what the process is told at start, the frames' meaning and the sizes of its
  shared memory, both ends' half of the protocol (frames and memory themselves are :mod:`halfserve.ipc`'s);
* :mod:`~halfserve.isolated.child`: the instance process's main;
* :mod:`~halfserve.isolated.engine`: the server process's side: the engine, and the dispatch of batches;
* :mod:`~halfserve.isolated.wire`: each process's wire end in the server process (its socket, memory, op in flight);
* :mod:`~halfserve.isolated.handling`: a team's handler run in the process, both ends of its ``handle`` op;
* :mod:`~halfserve.isolated.supervision`: their start, readiness, batch watchdog, restarts with backoff, and end.
"""
