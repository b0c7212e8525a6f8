"""Architecture registry: the server and the training module build the same ``nn.Module`` from a name.

A manifest names an architecture and its keyword arguments; :func:`build` looks the name up here. Nothing is ever
unpickled to obtain a model's code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

ModelFactory = Callable[..., nn.Module]
F = TypeVar("F", bound=ModelFactory)

_REGISTRY: dict[str, ModelFactory] = {}


class UnknownArchitectureError(KeyError):
    """The manifest names an architecture that is not registered."""

    def __str__(self) -> str:
        return str(self.args[0])


def register(name: str) -> Callable[[F], F]:
    """Register a model class or factory under ``name``."""

    def decorator(factory: F) -> F:
        if name in _REGISTRY:
            raise ValueError(f"architecture {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator


def build(name: str, **kwargs: Any) -> nn.Module:
    """Build a fresh (randomly initialised) model of architecture ``name``."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise UnknownArchitectureError(f"unknown architecture {name!r} (registered: {known})") from None
    return factory(**kwargs)


def names() -> list[str]:
    """Registered architecture names."""
    return sorted(_REGISTRY)


# Importing the modules registers their architectures.
from server.models import cnn, mlp, resnet  # noqa: E402, F401

__all__ = ["build", "names", "register", "UnknownArchitectureError"]
