"""A handler batch's ``handle`` op, both ends (halfserve.isolated.handling): the frame the server process sends read
back as the requests a handler is given, and the answers read out of the frame that comes back, past the outputs
placed before them; through the real frames of halfserve.ipc."""

from __future__ import annotations

from halfserve import handlers
from halfserve.ipc.frames import FrameReader, frame
from halfserve.isolated.handling import answers, handle_frame, requests


def through_the_wire(head: dict[str, object], *parts: bytes) -> tuple[dict[str, object], bytearray]:
    [(got, payload)] = FrameReader().feed(b"".join(frame(head, *parts)))
    return got, payload


def test_the_payloads_sent_are_the_requests_the_handler_is_given_in_order() -> None:
    """A text (a KServe V1 instance's data for a ``torchserve``-style handler) is given back as the text, its length
    in UTF-8 bytes on the wire, so the payloads after it are read from where they lie."""
    payloads: list[tuple[str, bytes | str, str]] = [
        ("body", b"\xff\xd8photo", "image/jpeg"),
        ("data", b"", "text/plain"),
        ("data", "caf\u00e9 \u2603", ""),
        ("body", b"{}", ""),
    ]
    head, parts = handle_frame(payloads)
    assert head["op"] == "handle"
    got, payload = through_the_wire(head, *parts)
    given = requests(got, payload)
    assert given == [handlers.request(f, data, kind) for f, data, kind in payloads]
    assert [type(r[f]) for r, (f, _, _) in zip(given, payloads, strict=True)] == [bytes, bytes, str, bytes]


def test_the_answers_are_read_from_their_offset_past_the_outputs() -> None:
    outputs, bodies = b"\x00" * 24, [b'{"a": 1}', b"", b"[2]"]
    head = {"id": 1, "answers": [len(outputs), [len(b) for b in bodies]]}
    got, payload = through_the_wire(head, outputs, *bodies)
    assert answers(got, payload) == bodies
