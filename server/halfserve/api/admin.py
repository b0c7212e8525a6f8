"""Model administration shared by the HTTP routes and the gRPC service: the repository index, loading from the store,
and a model's configuration and statistics in Triton's shapes. Each takes the contract's :class:`ModelAdmin` and
:class:`LocalModel` (the process that runs the models), never the repository itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from halfserve.api.dataplane.metadata import PLATFORM
from halfserve.api.dataplane.refusals import Refusal
from halfserve.api.errors import RefusedError, from_exception
from halfserve.batchstats import BatchStats
from halfserve.manifest import InputFormat, Manifest, Precision, TensorSpec, bytes_input, sent_inputs
from halfserve.serving import LocalModel, ModelAdmin, ModelState, shown
from halfserve.storage import StoreError

BACKEND = "pytorch"


class RepositoryState(str, Enum):
    """A model's state as the repository extension names it."""

    READY = "READY"
    LOADING = "LOADING"
    UNAVAILABLE = "UNAVAILABLE"


def index_entry(served: LocalModel) -> dict[str, object]:
    """One model of the repository index: name, version, state and, unless ready, the reason."""
    if served.state is ModelState.READY:
        state, reason = RepositoryState.READY, ""
    elif served.state is ModelState.LOADING:
        state, reason = RepositoryState.LOADING, "loading"
    else:
        state, reason = RepositoryState.UNAVAILABLE, served.error or served.state.value
    return {"name": served.name, "version": str(served.version), "state": state.value, "reason": reason}


def refuse_overrides(parameters: Iterable[str]) -> None:
    """Refuse as invalid a load whose parameters would override the model's configuration (``config``,
    ``file:...``), which is not supported, or that are no load parameter at all (``version``, a misspelling), which
    would otherwise be ignored unseen, naming them."""
    names = sorted(parameters)
    overrides = [k for k in names if k == "config" or k.startswith("file:")]
    if overrides:
        raise RefusedError(
            Refusal.INVALID, f"parameters: {', '.join(overrides)}: overriding a model's configuration is not supported"
        )
    if names:
        unknown = ", ".join(shown(k) for k in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise RefusedError(
            Refusal.INVALID,
            f"parameters: {unknown}: not a parameter a load takes; it loads the version the store serves "
            '(another: POST /models/{name}/load with {"version": N})',
        )


async def load_from_store(
    repo: ModelAdmin, name: str, version: int | None = None, precision: Precision | None = None
) -> LocalModel:
    """Load ``name`` from the store: refused as invalid for an invalid name or a checkpoint that fails, as not found
    when the store has no such model or version."""
    try:
        present = repo.stored_versions(name)
    except StoreError as e:
        raise RefusedError(Refusal.INVALID, str(e)) from None
    if present is None:
        raise RefusedError(Refusal.NOT_FOUND, f"model {name!r} is not in the store")
    if version is not None and version not in present:
        raise RefusedError(Refusal.NOT_FOUND, f"model {name!r} has no version {version} in the store")
    try:
        return await repo.load(name, version, precision)
    except StoreError as e:
        raise RefusedError(Refusal.INVALID, f"failed to load {name!r}: {e}") from None
    except Exception as e:
        raise from_exception(e) from None


def index_entries(repo: ModelAdmin, ready_only: bool) -> list[dict[str, object]]:
    """The repository index, by name: the served models, then the store's others as not loaded."""
    entries = [index_entry(m) for m in repo.models.values()]
    try:
        others = [n for n in repo.stored_models() if n not in repo.models]
    except StoreError:
        others = []
    entries += [{"name": n, "state": RepositoryState.UNAVAILABLE.value, "reason": "not loaded"} for n in others]
    if ready_only:
        entries = [e for e in entries if e["state"] == RepositoryState.READY.value]
    return sorted(entries, key=lambda e: str(e["name"]))


def _tensor_config(spec: TensorSpec) -> dict[str, object]:
    config: dict[str, object] = {"name": spec.name, "data_type": f"TYPE_{spec.datatype.value}", "dims": spec.wire_shape}
    if not spec.shape:  # the model returns [B]: Triton's spelling of it
        config["reshape"] = {"shape": []}
    return config


def input_configs(manifest: Manifest) -> list[dict[str, object]]:
    """The inputs clients send as Triton's ``ModelInput``: each with its ``format`` (Triton's image clients lay out
    the pixels they send by it), and the ``BYTES`` input a text or photo model takes (``TYPE_STRING``, one text or
    encoded photo per row), as the metadata lists them. That input and the tensor it feeds are each ``optional``: a
    request gives one or the other, and a client that fills every input not optional (perf_analyzer) gives neither
    twice."""
    section = manifest.text or manifest.image
    either = set() if section is None else {section.input, section.feeds}
    configs: list[dict[str, object]] = []
    for s in sent_inputs(manifest):
        config: dict[str, object] = {**_tensor_config(s), "format": s.image_format.value}
        if s.name in either:
            config["optional"] = True
        configs.append(config)
    sent = bytes_input(manifest)
    if sent is not None:
        configs.append(
            {"name": sent, "data_type": "TYPE_STRING", "dims": [1], "format": InputFormat.NONE.value, "optional": True}
        )
    return configs


def model_config(served: LocalModel, device_type: str, device_index: int | None) -> dict[str, object]:
    """``served`` as a Triton ``ModelConfig``: per-sample ``dims`` (the batch dimension is implied by
    ``max_batch_size``), the dynamic batcher's delay, one instance on the serving device. Settings Triton has no
    field for (precision, the queue bound in rows, the adaptive delay) are string ``parameters``."""
    b = served.batching
    gpu = device_type == "cuda"
    instance: dict[str, object] = {"name": f"{served.name}_0", "kind": "KIND_GPU" if gpu else "KIND_CPU", "count": 1}
    if gpu:
        instance["gpus"] = [device_index or 0]
    parameters = {
        "max_queue_rows": {"string_value": str(b.max_queue_rows)},
        # Triton has no field for it: max_queue_delay_microseconds is then the longest wait, not every wait.
        "adaptive_delay": {"string_value": str(b.adaptive_delay).lower()},
    }
    if served.precision is not None:
        parameters["precision"] = {"string_value": served.precision.value}
    dynamic_batching: dict[str, object] = {"max_queue_delay_microseconds": round(b.max_delay_ms * 1000)}
    if b.request_timeout_ms is not None:
        # Triton's own name for a queued request's deadline; a client's shorter parameters.timeout overrides it.
        dynamic_batching["default_queue_policy"] = {
            "timeout_action": "REJECT",
            "default_timeout_microseconds": round(b.request_timeout_ms * 1000),
            "allow_timeout_override": True,
        }
    return {
        "name": served.name,
        "platform": PLATFORM,
        "backend": BACKEND,
        "version_policy": {"specific": {"versions": [served.version]}},
        "max_batch_size": b.max_batch_size,
        "input": input_configs(served.manifest),
        "output": [_tensor_config(s) for s in served.manifest.outputs],
        "dynamic_batching": dynamic_batching,
        "instance_group": [instance],
        "parameters": parameters,
    }


def _duration(count: int, seconds: float) -> dict[str, int]:
    return {"count": count, "ns": round(seconds * 1e9)}


def model_stats(served: LocalModel, stats: BatchStats) -> dict[str, object]:
    """One ``model_stats`` entry.

    ``success`` and ``fail`` count requests, with their time from queueing to answer; ``queue`` counts the chunks
    cut into batches (a request larger than a batch waits once per chunk). The engine times a batch as a whole
    (host-to-device copy, cast, forward, copy back), so ``compute_infer`` holds it all, counted per batch, and
    ``compute_input`` / ``compute_output`` hold counts with zero time.
    """
    compute = sum(stats.batch_compute_seconds.values())
    return {
        "name": served.name,
        "version": str(served.version),
        "last_inference": round(stats.last_inference * 1000),
        "inference_count": stats.rows,
        "execution_count": stats.batches,
        "inference_stats": {
            "success": _duration(stats.succeeded, stats.success_seconds),
            "fail": _duration(stats.failed, stats.fail_seconds),
            "queue": _duration(stats.queued_chunks, stats.queue_seconds),
            "compute_input": _duration(stats.batches, 0.0),
            "compute_infer": _duration(stats.batches, compute),
            "compute_output": _duration(stats.batches, 0.0),
            "cache_hit": _duration(0, 0.0),
            "cache_miss": _duration(0, 0.0),
        },
        "batch_stats": [
            {
                "batch_size": size,
                "compute_input": _duration(count, 0.0),
                "compute_infer": _duration(count, stats.batch_compute_seconds[size]),
                "compute_output": _duration(count, 0.0),
            }
            for size, count in sorted(stats.batch_sizes.items())
        ],
    }
