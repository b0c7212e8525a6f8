"""TorchServe's ``ts.utils``: the helpers handlers import."""
