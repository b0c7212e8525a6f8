"""TorchServe's ``ts`` package as far as a handler file needs it to import and run beside halfserve: imported under
the name ``ts`` only while a torchserve-style handler is built, and only where no real ``ts`` is installed
(:mod:`halfserve.tscompat`). The server loads the model and runs the forward, so nothing here loads a model."""
