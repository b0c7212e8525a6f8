"""The count of JSON values and containers that bounds a body's parse (``max_json_values``), at its edges.

A body no longer than the limit is parsed without the count (no byte can add more than one to it); one byte past
the limit is counted, and refused when its values and containers exceed it.
"""

from __future__ import annotations

import asyncio

import pytest

from halfserve.api.dataplane.bounds import parse_json
from halfserve.api.errors import from_exception
from halfserve.errors import OverLimitError


def test_a_body_as_long_as_the_limit_is_parsed() -> None:
    body = b"[" + b",".join([b"1"] * 4) + b"]"  # 9 bytes, 1 container and 3 separators
    assert asyncio.run(parse_json(body, max_values=len(body))) == [1, 1, 1, 1]


def test_a_longer_body_over_the_count_is_refused() -> None:
    body = b"[[],[],[]]"  # 10 bytes: 4 containers and 2 separators
    with pytest.raises(OverLimitError) as refused:
        asyncio.run(parse_json(body, max_values=5))
    answer = from_exception(refused.value)
    assert answer.status == 413
    assert "max_json_values" in answer.message


def test_a_longer_body_under_the_count_is_parsed() -> None:
    body = b'{"inputs": [[0.25, 0.5]]}'  # 25 bytes: 3 containers and 1 separator
    assert asyncio.run(parse_json(body, max_values=4)) == {"inputs": [[0.25, 0.5]]}
