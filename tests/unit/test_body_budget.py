"""The bytes of HTTP bodies still arriving, shared between clients (:class:`halfserve.bodybudget.BodyBudget`), over
made-up bodies and a made-up clock: who is refused, who gives way, and that every byte counted is given back."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from halfserve.bodybudget import BodyBudget


@dataclass(eq=False)
class FakeBody:
    peer: str
    pending: int = 0
    arriving_since: float = 0.0
    held_by_server: bool = False
    given_up: list[str] = field(default_factory=list)

    def paused(self) -> bool:
        return self.held_by_server

    def give_up(self, why: str) -> None:
        self.given_up.append(why)


def test_one_address_is_held_to_its_share_and_others_are_not() -> None:
    budget = BodyBudget.of(1000, 0.5)
    a1, a2, b = FakeBody("a"), FakeBody("a"), FakeBody("b")
    assert budget.claim(a1, 300, now=0.0) is None
    assert budget.claim(a2, 200, now=0.0) is None
    refusal = budget.claim(a2, 1, now=budget.grace / 2)  # a1 too young to give way
    assert refusal is not None
    assert refusal.status == 429
    assert "requests of a have 501 bytes" in refusal.message
    assert "over 500 (http_peer_share" in refusal.message
    assert budget.claim(b, 500, now=budget.grace / 2) is None  # another address has a share of its own
    assert (budget.held, budget.by_peer) == (1000, {"a": 500, "b": 500})


def test_a_body_past_one_address_s_share_is_a_413_whatever_else_arrives() -> None:
    budget = BodyBudget.of(1000, 0.5)
    body = FakeBody("a")
    assert budget.claim(body, 500, now=0.0) is None
    refusal = budget.claim(body, 1, now=0.1)
    assert refusal is not None
    assert refusal.status == 413  # retrying cannot help: not a 429 with Retry-After
    assert refusal.message == (
        "body: more than 500 bytes, the most one client address's bodies may hold while they arrive "
        "(http_peer_share of http_pending_bytes)"
    )


def test_a_full_budget_refuses_the_body_asking_while_none_is_late() -> None:
    budget = BodyBudget.of(1000, 1.0)
    bodies = [FakeBody(p) for p in "abc"]
    for body in bodies:
        assert budget.claim(body, 300, now=0.0) is None
    newcomer = FakeBody("d")
    refusal = budget.claim(newcomer, 200, now=budget.grace - 0.1)
    assert refusal is not None
    assert refusal.status == 503
    assert refusal.message.endswith(
        "900 bytes of request bodies are arriving, and 200 more would pass 1000 (http_pending_bytes)"
    )
    assert not any(b.given_up for b in bodies)
    assert budget.held == 900
    assert newcomer.pending == 0


def test_the_slowest_late_body_gives_way_and_its_bytes_are_released() -> None:
    budget = BodyBudget.of(1000, 1.0)
    slow, fast = FakeBody("slow"), FakeBody("fast")
    assert budget.claim(slow, 100, now=0.0) is None
    assert budget.claim(fast, 100, now=0.0) is None
    assert budget.claim(fast, 600, now=1.0) is None  # fast: 700 bytes in 3 s, slow: 100 in 3 s
    newcomer = FakeBody("new")
    assert budget.claim(newcomer, 250, now=3.0) is None
    assert len(slow.given_up) == 1
    assert not fast.given_up
    assert "arrived at 33 bytes/s, and its bytes went to a faster one (http_pending_bytes: 1000" in slow.given_up[0]
    assert (budget.held, budget.by_peer) == (950, {"fast": 700, "new": 250})
    assert slow.pending == 0
    assert slow not in budget.bodies


def test_only_as_many_give_way_as_the_asking_body_needs() -> None:
    budget = BodyBudget.of(1000, 1.0)
    bodies = [FakeBody(f"p{i}") for i in range(4)]
    for i, body in enumerate(bodies):
        assert budget.claim(body, 200 + 10 * i, now=0.0) is None  # p0 the slowest
    assert budget.claim(FakeBody("new"), 300, now=5.0) is None  # 860 held: 160 free, 140 more needed
    assert [bool(b.given_up) for b in bodies] == [True, False, False, False]
    assert budget.held == 960


def test_a_body_the_server_stopped_reading_never_gives_way() -> None:
    budget = BodyBudget.of(1000, 1.0)
    waiting = FakeBody("a", held_by_server=True)
    assert budget.claim(waiting, 900, now=0.0) is None
    refusal = budget.claim(FakeBody("b"), 200, now=60.0)
    assert refusal is not None
    assert refusal.status == 503
    assert not waiting.given_up


def test_an_address_over_its_share_gives_up_its_own_slow_body_first() -> None:
    budget = BodyBudget.of(1000, 0.5)
    own_slow, other = FakeBody("a"), FakeBody("b")
    assert budget.claim(own_slow, 400, now=0.0) is None
    assert budget.claim(other, 50, now=0.0) is None  # slower, but another address's: not the share's to take
    upload = FakeBody("a")
    assert budget.claim(upload, 300, now=10.0) is None
    assert own_slow.given_up
    assert not other.given_up
    assert budget.by_peer == {"a": 300, "b": 50}


@pytest.mark.parametrize("order", ["whole", "refused", "twice"])
def test_release_gives_every_byte_back_once(order: str) -> None:
    budget = BodyBudget.of(1000, 1.0)
    body, other = FakeBody("a"), FakeBody("a")
    budget.claim(body, 100, now=0.0)
    budget.claim(other, 50, now=0.0)
    budget.claim(body, 100, now=0.1)
    budget.release(body)
    if order == "twice":
        budget.release(body)  # a refused body's connection is lost after
    if order == "refused":
        assert budget.claim(body, 2000, now=0.2) is not None
    assert (budget.held, budget.by_peer, body.pending) == (50, {"a": 50}, 0)
    budget.release(other)
    assert (budget.held, budget.by_peer, budget.bodies) == (0, {}, {})
    assert budget.claim(FakeBody("a"), 1000, now=1.0) is None


def test_asking_for_a_declared_length_counts_nothing_and_gives_nothing_up() -> None:
    # Expect: 100-continue: the answer decides whether the client sends its body at all.
    budget = BodyBudget.of(1000, 0.5)
    slow_a, slow_b, young = FakeBody("a"), FakeBody("b"), FakeBody("c")
    assert budget.claim(slow_a, 300, now=0.0) is None
    assert budget.claim(slow_b, 100, now=0.0) is None
    assert budget.claim(young, 400, now=9.9) is None
    asking = FakeBody("d")
    assert budget.ask(asking, 500, now=10.0) is None  # fits once the two slow bodies (400 bytes) give way
    assert (budget.held, asking.pending, slow_a.given_up, slow_b.given_up) == (800, 0, [], [])
    refusal = budget.ask(asking, 501, now=10.0)  # over its address's share
    assert refusal is not None
    assert refusal.status == 413
    # Past what even both slow bodies would free: the young one has not had its grace.
    assert budget.claim(FakeBody("d"), 200, now=10.0) is None  # 1000 held, 600 of them young
    refusal = budget.ask(FakeBody("e"), 500, now=10.0)
    assert refusal is not None
    assert refusal.status == 503
    assert (slow_a.given_up, slow_b.given_up) == ([], [])


def test_asking_over_an_address_s_share_counts_its_own_slow_bodies_as_room() -> None:
    budget = BodyBudget.of(1000, 0.5)
    own_slow = FakeBody("a")
    assert budget.claim(own_slow, 400, now=0.0) is None
    assert budget.ask(FakeBody("a"), 300, now=10.0) is None  # its slow body would give way
    assert not own_slow.given_up
    refusal = budget.ask(FakeBody("a"), 300, now=0.1)  # too young to
    assert refusal is not None
    assert refusal.status == 429
    assert refusal.message.startswith("body: the requests of a have 700 bytes of bodies arriving, over 500")


def test_no_body_gives_way_where_that_would_not_make_room() -> None:
    budget = BodyBudget.of(1000, 1.0)
    slow, young = FakeBody("a"), FakeBody("b")
    assert budget.claim(slow, 100, now=0.0) is None
    assert budget.claim(young, 800, now=9.9) is None  # within its grace
    refusal = budget.claim(FakeBody("c"), 300, now=10.0)  # even with the slow body's 100 bytes, 200 short
    assert refusal is not None
    assert refusal.status == 503
    assert slow.given_up == []  # it was given up, and the body asking refused all the same
    assert budget.held == 900


def test_claim_and_ask_judge_alike_over_made_up_traffic() -> None:
    import random

    rng = random.Random(0)
    for _ in range(300):
        budget = BodyBudget.of(1000, rng.choice([0.5, 1.0]))
        bodies = [FakeBody(rng.choice("abc"), held_by_server=rng.random() < 0.2) for _ in range(6)]
        now = 0.0
        for body in bodies:
            now += rng.random()
            budget.claim(body, rng.randrange(1, 400), now)
        asking = FakeBody(rng.choice("abcd"))
        size, now = rng.randrange(1, 600), now + rng.random()
        before = [len(b.given_up) for b in bodies]
        asked = budget.ask(asking, size, now)
        assert [len(b.given_up) for b in bodies] == before  # asking gives nothing up
        claimed = budget.claim(asking, size, now)
        assert (asked is None) == (claimed is None)
        assert asked is None or claimed is None or asked.status == claimed.status
        if claimed is not None:
            assert [len(b.given_up) for b in bodies] == before  # refused: nobody gave way for it
