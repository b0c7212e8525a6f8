"""What a benchmark ran on: CPU model, the vector units torch uses, bf16 support, allocator, GPU.

Benchmark numbers from different machines are only comparable with these beside them: the same "AMD EPYC" may or
may not have AVX512-BF16 (bf16 1.9x fp32 with it, slower than fp32 without), and glibc malloc against jemalloc
changes fp32 CNN forwards by about 2x.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

from halfserve.precision import cpu_has_native_bf16


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def allocator(environ: dict[str, str] | None = None) -> str:
    """The malloc the process (and servers it starts with the same environment) uses, from ``LD_PRELOAD``."""
    preload = (environ if environ is not None else os.environ).get("LD_PRELOAD", "")
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if name in preload:
            return f"{name} (LD_PRELOAD)"
    return "glibc malloc"


def describe() -> dict[str, Any]:
    """One JSON-ready description of this host for a benchmark's results."""
    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": cpu_has_native_bf16(),
        "allocator": allocator(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["tf32_matmul"] = torch.backends.cuda.matmul.allow_tf32
        info["tf32_cudnn"] = torch.backends.cudnn.allow_tf32
    return info
