"""Compiled forwards and fixed shapes: what torch.compile and cuDNN keep per shape, set up so an engine's own."""

from __future__ import annotations

import logging
import types
from collections.abc import Callable

import torch

from halfserve import compilecache

log = logging.getLogger(__name__)


def own_code(method: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``method`` bound to a copy of its function's code object.

    torch.compile keeps compiled shapes per code object, and every engine's ``eager`` is one code object: their
    entries would add up over models, precisions and reloads, none freed, each checked in turn on every call, and past
    its recompile limit (8) it would run eager forwards and say so only in a log line. With a code object of its own,
    an engine's compiled shapes are its own and go with it.
    """
    fn = method.__func__  # type: ignore[attr-defined]
    code = fn.__code__.replace()  # an equal code object, not the same one
    own = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    return types.MethodType(own, method.__self__)  # type: ignore[attr-defined]


def compiled(
    method: Callable[[torch.Tensor], torch.Tensor], cache: compilecache.CompileCache | None
) -> tuple[Callable[[torch.Tensor], torch.Tensor], types.CodeType]:
    """``method`` compiled with torch.compile, one fixed shape per batch size, and the code object whose compiled
    shapes are its own (:func:`own_code`). With a usable compile ``cache``, torch's kernel cache goes in its folder
    (:func:`halfserve.compilecache.keep_kernels`): set before torch.compile, which settles torch's cache folder."""
    if cache is not None and cache.usable:
        compilecache.keep_kernels(cache)
    own = own_code(method)
    return torch.compile(own, dynamic=False), own.__func__.__code__  # type: ignore[attr-defined]


# torch.compile's limits and cache are torch._dynamo's, not public API: read where they are, with a way out when a
# torch release moves them (no upper bound on torch, whose CUDA build a GPU host brings), so a release that renames
# them costs recompiles under load and a warning, not a failed load.
_LIMITS = ("recompile_limit", "cache_size_limit")  # the name since torch 2.6, and the one before


def allow_compiled_shapes(count: int) -> bool:
    """Let torch.compile keep ``count`` compiled shapes of one code object on this thread (its default is 8; an
    engine can have more buckets). Its limits are read on the compiling thread, so an instance sets them on its own.
    Returns False (and changes nothing) where this torch has no such limit to set."""
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    for name in _LIMITS:
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, max(getattr(config, name), count))
            return True
    log.warning("torch %s has no torch.compile recompile limit to raise: buckets past 8 run eagerly", torch.__version__)
    return False


def forget_compiled(code: types.CodeType) -> bool:
    """Drop every shape compiled for ``code`` (an engine's own, :func:`own_code`), before compiling them again.
    Returns False where this torch has no way to: the shapes then stay, and count toward the recompile limit."""
    remove = getattr(getattr(getattr(torch, "_dynamo", None), "eval_frame", None), "remove_from_cache", None)
    if remove is None:
        log.warning("torch %s cannot drop compiled shapes: the old ones stay cached", torch.__version__)
        return False
    remove(code)
    return True


def tune_cudnn(device: torch.device, fixed_shapes: bool) -> None:
    """Process-wide: let cuDNN time its algorithms once per input shape and keep the fastest, on a CUDA device whose
    engines run a few fixed shapes (padded to buckets, each seen at warm-up). With shapes that vary, every new one
    would pay that timing (about a second per shape for ResNet-50) under load, so it stays off."""
    torch.backends.cudnn.benchmark = device.type == "cuda" and fixed_shapes
