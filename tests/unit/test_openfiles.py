"""The open-file limit at start: raised to the hard limit, and a warning naming the settings when still too low. Run
in a child process, whose limits the test may lower without touching the suite's own."""

from __future__ import annotations

import json
import subprocess
import sys

from halfserve.openfiles import SPARE, needed
from halfserve.settings import Settings

CHILD = """
import json, logging, resource, sys
from halfserve.openfiles import raise_limit
from halfserve.settings import Settings
soft, hard = json.loads(sys.argv[1])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
print(json.dumps([raise_limit(Settings()), resource.getrlimit(resource.RLIMIT_NOFILE)[0]]))
"""


def run(soft: int, hard: int) -> tuple[list[int], str]:
    r = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps([soft, hard])], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1]), r.stderr


def test_the_soft_limit_is_raised_to_the_hard_one_and_a_limit_too_low_is_named() -> None:
    want = needed(Settings())
    assert want == 1024 + 256 + SPARE  # HTTP connections, regions, spare
    assert needed(Settings(grpc=True)) == 2 * 1024 + 256 + SPARE  # and gRPC's
    (limit, after), said = run(256, want + 100)
    assert limit == after == want + 100  # had stayed at the soft limit: 1024 is max_connections alone
    assert "WARNING" not in said
    (limit, after), said = run(256, 1024)
    assert limit == after == 1024
    assert f"the open-file limit (1024, hard 1024) is below what the settings may hold open ({want}:" in said
