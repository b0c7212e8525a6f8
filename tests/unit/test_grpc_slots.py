"""The slots of calls waiting for a gRPC request message (``halfserve.api.grpc.grpc_limits.Slots``), without a
server."""

from __future__ import annotations

import asyncio

import pytest

from halfserve.api.dataplane.refusals import Refusal
from halfserve.api.errors import RefusedError
from halfserve.api.grpc.grpc_limits import Slots


def test_one_address_holds_its_share_and_no_more_while_its_calls_are_on_time() -> None:
    async def main() -> None:
        slots = Slots(4, 2, 60.0, "waiting", "grpc_peer_share")
        slots.claim("a"), slots.claim("a")
        with pytest.raises(RefusedError) as info:
            slots.claim("a")
        assert info.value.refusal is Refusal.TOO_MANY
        assert "2 calls from a are waiting (grpc_peer_share: 2)" in info.value.message
        slots.claim("b"), slots.claim("b")
        with pytest.raises(RefusedError, match="4 calls are waiting"):
            slots.claim("c")

    asyncio.run(main())


def test_a_late_call_of_the_address_holding_the_most_gives_its_slot_up() -> None:
    async def main() -> None:
        slots = Slots(3, 3, 0.0, "waiting", "grpc_peer_share")  # every call is late at once
        first_b = slots.claim("b")
        first_a, second_a = slots.claim("a"), slots.claim("a")
        mine = slots.claim("c")
        assert first_a.evicted.done()  # a held two: its longest waiting goes, not b's older one
        assert not first_b.evicted.done()
        assert not second_a.evicted.done()
        slots.release(first_a)  # the evicted call's own release changes nothing
        assert slots.held == 3
        for h in (first_b, second_a, mine):
            slots.release(h)
        assert (slots.held, slots.by_peer) == (0, {})

    asyncio.run(main())
