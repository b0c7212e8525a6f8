"""TorchServe's ``ts.torch_handler``: the base and image handlers a handler file subclasses."""
