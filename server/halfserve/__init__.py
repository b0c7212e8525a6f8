"""halfserve: serve trained PyTorch models over HTTP in half precision, with dynamic batching."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from halfserve.version import __version__

__all__ = ["Precision", "Settings", "__version__", "create_app"]

if TYPE_CHECKING:
    from halfserve.app import create_app
    from halfserve.manifest import Precision
    from halfserve.settings import Settings


def __getattr__(name: str) -> Any:
    # Lazy, so that importing a light module (halfserve.batching) does not pull in torch and FastAPI.
    if name == "create_app":
        from halfserve.app import create_app

        return create_app
    if name == "Precision":
        from halfserve.manifest import Precision

        return Precision
    if name == "Settings":
        from halfserve.settings import Settings

        return Settings
    raise AttributeError(f"module 'halfserve' has no attribute {name!r}")
