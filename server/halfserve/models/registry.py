"""The architectures this package ships, by name: filled by its modules' ``@register`` as they are imported."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

ModelFactory = Callable[..., nn.Module]
F = TypeVar("F", bound=ModelFactory)

_REGISTRY: dict[str, ModelFactory] = {}


def register(name: str) -> Callable[[F], F]:
    """Register a model class or factory under ``name``."""

    def decorator(factory: F) -> F:
        if name in _REGISTRY:
            raise ValueError(f"architecture {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorator
