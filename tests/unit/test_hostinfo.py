from __future__ import annotations

import json

import pytest
import torch

from halfserve import hostinfo, precision


@pytest.mark.parametrize(
    ("preload", "expected"),
    [
        ("", "glibc malloc"),
        ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc (LD_PRELOAD)"),
        ("/lib/libfoo.so:/usr/lib/libtcmalloc_minimal.so.4", "tcmalloc (LD_PRELOAD)"),
    ],
)
def test_allocator_is_read_from_ld_preload(preload: str, expected: str) -> None:
    assert hostinfo.allocator({"LD_PRELOAD": preload}) == expected


def test_describe_names_what_decides_half_precision_speed() -> None:
    info = hostinfo.describe()
    json.dumps(info)  # goes into a results file as is
    assert info["native_bf16"] is precision.cpu_has_native_bf16()
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert info["cpu"]
    assert ("gpu" in info) is torch.cuda.is_available()
