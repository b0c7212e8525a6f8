"""TorchServe's ``Context``: what ``initialize(context)`` is given."""

from __future__ import annotations

from typing import Any


class Context:
    """The model's name, its folder (``model_dir``: the archive's extra files), the archive's manifest and the
    system properties, as TorchServe's worker builds them, with the server's ``--max-image-pixels`` as
    ``max_image_pixels`` (``VisionHandler`` holds images to it); no request headers (``/predictions`` does not carry
    them to handlers)."""

    def __init__(
        self,
        model_name: str,
        model_dir: str,
        manifest: dict[str, Any],
        batch_size: int,
        gpu: int | None,
        mms_version: str,
        limit_max_image_pixels: bool = True,
        metrics: Any = None,
        model_yaml_config: dict[str, Any] | None = None,
        max_image_pixels: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.manifest = manifest
        self._system_properties: dict[str, Any] = {
            "model_dir": model_dir,
            "gpu_id": gpu,
            "batch_size": batch_size,
            "server_name": "halfserve",
            "server_version": mms_version,
            "limit_max_image_pixels": limit_max_image_pixels,
            "max_image_pixels": max_image_pixels,
        }
        self.request_ids: dict[int, str] | None = None
        self.request_processor: Any = None
        self._metrics = metrics
        self.model_yaml_config = model_yaml_config or {}

    @property
    def system_properties(self) -> dict[str, Any]:
        return self._system_properties

    @property
    def metrics(self) -> Any:
        return self._metrics

    def get_request_id(self, idx: int = 0) -> str | None:
        return None

    def get_request_header(self, idx: int, key: str) -> str | None:
        return None

    def get_all_request_header(self, idx: int) -> dict[str, str]:
        return {}

    def set_response_content_type(self, idx: int, value: str) -> None:
        """Kept for handlers that call it: halfserve answers JSON."""

    def get_response_content_type(self, idx: int) -> str | None:
        return None

    def set_response_status(self, code: int = 200, phrase: str = "", idx: int = 0) -> None:
        """Kept for handlers that call it: a handler's failure is its exception (docs/handlers.md)."""
