"""TorchServe's ``BaseHandler`` without the model: ``initialize`` reads the context and the label mapping, as
TorchServe's does before it loads the model; the server loads the model itself and runs the forward, so
``inference`` and ``handle`` are not called here (a handler overriding either is refused where it is built)."""

from __future__ import annotations

import os
from typing import Any

import torch

from ..context import Context
from ..utils.util import load_label_mapping


class BaseHandler:
    """The base a TorchServe handler file subclasses."""

    def __init__(self) -> None:
        self.model: Any = None
        self.mapping: dict[str, Any] | None = None
        self.device = torch.device("cpu")
        self.map_location = "cpu"
        self.initialized = False
        self.context: Context | None = None
        self.manifest: dict[str, Any] | None = None
        self.model_pt_path: str | None = None
        self.explain = False
        self.target = 0
        self.model_yaml_config: dict[str, Any] = {}

    def initialize(self, context: Context) -> None:
        """The context, the archive's manifest and ``index_to_name.json`` from ``model_dir``. The handler's tensors
        stay on the CPU: the server moves the batch to its device."""
        self.context = context
        self.manifest = context.manifest
        self.model_yaml_config = context.model_yaml_config
        model_dir = str(context.system_properties.get("model_dir") or "")
        serialized = (self.manifest or {}).get("model", {}).get("serializedFile")
        if serialized:
            self.model_pt_path = os.path.join(model_dir, serialized)
        self.mapping = load_label_mapping(os.path.join(model_dir, "index_to_name.json"))
        self.initialized = True

    def preprocess(self, data: list[dict[str, Any]]) -> torch.Tensor:
        """TorchServe's default: each row's ``data`` or ``body`` as a tensor."""
        return torch.as_tensor([row.get("data") or row.get("body") for row in data], device=self.device)

    def inference(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("the server runs the forward; inference is not called")

    def postprocess(self, data: torch.Tensor) -> list[Any]:
        """TorchServe's default: the outputs as lists, one per row."""
        answer: list[Any] = data.tolist()
        return answer

    def handle(self, data: Any, context: Context) -> Any:
        raise NotImplementedError("the server calls preprocess and postprocess; handle is not called")
