"""How a model is served: its dynamic batching limits and its execution on the device (instances, batch buckets,
compilation, isolation); the manifest's ``batching`` and ``execution`` sections. Torch-free, as the manifest is.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Batching(BaseModel):
    """Dynamic batching limits for one model."""

    model_config = ConfigDict(extra="forbid")

    max_batch_size: int = Field(default=64, ge=1, le=8192)
    max_delay_ms: float = Field(default=2.0, ge=0.0, le=10_000.0)
    max_queue_rows: int = Field(default=4096, ge=1)
    request_timeout_ms: float | None = Field(default=None, gt=0.0, le=3_600_000.0)
    """Answer a request 504 when its rows have not all started within this time; a client may ask for less."""
    adaptive_delay: bool = True
    """An idle model waits for more requests no longer than its recent batches took to run (and never longer than
    ``max_delay_ms``), and no longer once as many rows are queued as it answered since its last batch (its clients
    are back): a lone request to a model whose forward is cheap starts at once, while a model whose forward takes
    longer than the delay still waits it out to gather batches. Off: always ``max_delay_ms``."""
    group_lengths: bool = True
    """For variable inputs: batch requests of similar lengths together (the same power-of-two length bucket) and pad
    to the bucket; off, any lengths share a batch, padded to its longest."""

    @model_validator(mode="after")
    def _queue_holds_a_batch(self) -> Batching:
        if self.max_queue_rows < self.max_batch_size:
            raise ValueError(
                f"max_queue_rows ({self.max_queue_rows}) must be at least max_batch_size ({self.max_batch_size})"
            )
        return self


class Compile(str, Enum):
    """What is done to the served model per batch bucket at load, beyond casting it."""

    NONE = "none"
    """Eager forwards."""
    CUDA_GRAPHS = "cuda_graphs"
    """Capture one CUDA graph per batch bucket at warm-up and replay it (CUDA only; ignored on a CPU)."""
    INDUCTOR = "inductor"
    """``torch.compile`` (TorchInductor) of the input preparation and the forward, one fixed shape per batch bucket,
    compiled at warm-up: fused kernels and planned buffers. On a CPU it builds C++ kernels, so it needs a C++
    compiler where the server runs."""
    AOTI = "aoti"
    """AOTInductor: the input preparation and the forward exported (``torch.export``, batch dimension dynamic where
    the model exports so) and compiled ahead of time into a package kept in the compile cache, so a start that finds
    it loads a library and traces nothing (:mod:`halfserve.aoti`). Needs a C++ compiler to build, not to load."""


class Isolation(str, Enum):
    """Where a model's engine instances run."""

    THREAD = "thread"
    """Threads of the server process: no copy between the batcher and the instance, but the instance's torch calls
    share the GIL with the event loop."""
    PROCESS = "process"
    """A process each, fed through shared memory (:mod:`halfserve.isolated`): the instance's host work waits for no lock
    the event loop holds, for one copy of each batch's rows and a process (CUDA context, weights) per instance."""


class Execution(BaseModel):
    """How a model runs on its device: instances, batch buckets, CUDA graphs, memory format.

    ``None`` means "decided per device": padding to buckets and ``channels_last`` for convolutional models are on
    for CUDA, off for a CPU.
    """

    model_config = ConfigDict(extra="forbid")

    instances: int = Field(default=1, ge=1, le=16)
    """Engine instances sharing the model's weights and its batcher queue (Triton's instance count): each has its
    own thread, CUDA stream and staging buffers and takes the next batch when idle, so one instance's copies overlap
    another's compute."""
    pad_to_bucket: bool | None = None
    """Pad each batch up to the next bucket: a few fixed shapes, each warmed up (and captured as a CUDA graph) at
    load."""
    batch_buckets: list[int] | None = None
    """The batch sizes padded up to (``max_batch_size`` is always one; larger sizes are dropped). Default: powers of
    two. Finer buckets pad less (a batch of 20 runs as 24 rather than 32) for a few more captures at load."""
    compile: Compile = Compile.NONE
    channels_last: bool | None = None
    """NHWC activations and weights for models with 2-D convolutions (cuDNN's tensor-core kernels want NHWC)."""
    isolation: Isolation | None = None
    """Instances as threads of the server process or as processes of their own; ``None``: per device
    (:func:`halfserve.placement.choose`). The server's ``--placement`` outranks it."""

    @field_validator("batch_buckets")
    @classmethod
    def _buckets_positive(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 1):
            raise ValueError("batch_buckets needs at least one size, each >= 1")
        return v

    @model_validator(mode="after")
    def _compiled_need_buckets(self) -> Execution:
        if self.compile is not Compile.NONE and self.pad_to_bucket is False:
            raise ValueError(
                f"compile {self.compile.value!r} runs fixed shapes: it needs pad_to_bucket (true or unset)"
            )
        return self
