"""What a manifest section reads of a declared tensor (the manifest's ``TensorSpec``, in a module above the sections):
a protocol, so that the sections (:mod:`halfserve.imageinput`, :mod:`halfserve.answershapes`) check their tensors
without importing the manifest. Torch-free."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np


class DeclaredType(Protocol):
    """A tensor's data type (the manifest's ``DataType``)."""

    @property
    def value(self) -> str: ...
    @property
    def numpy(self) -> np.dtype[Any]: ...


class DeclaredTensor(Protocol):
    """A declared input or output (the manifest's ``TensorSpec``): its name, per-sample shape and data type."""

    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def datatype(self) -> DeclaredType: ...
