"""A ``ModelStreamInfer`` client that sends requests and never reads the answers: a request holds its slot of the
stream's in-flight bound until its answer is written, so the server stops reading the stream once the bound's answers
(and what the client's HTTP/2 window takes) wait, rather than answering every request into a queue without bound. The
count of answered requests is read from ``/metrics``; another client is served meanwhile."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from halfserve.api.grpc.grpc_service import STREAM_IN_FLIGHT
from tests.security.raw_h2 import Connection, grpc_message
from tests.security.test_grpc_abuse import MODEL, Endpoint, StartServer, healthy, serve
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

STREAM = "/inference.GRPCInferenceService/ModelStreamInfer"
SENT = 5000
BOUND = STREAM_IN_FLIGHT + 1500
"""Requests a non-reading client can have answered: the in-flight bound, and the answers (about 75 bytes each, so
some 900) that the client's 64 KiB HTTP/2 window lets grpcio write before it waits. Without the bound, all SENT."""


@pytest.fixture(scope="module")
def endpoint(server_factory: StartServer, served_tiny_store: Path) -> Endpoint:
    return serve(server_factory, served_tiny_store)


def _answered(endpoint: Endpoint) -> int:
    text = httpx.get(f"{endpoint.process.url}/metrics", timeout=10).text
    counts = re.findall(r'halfserve_requests_total\{[^}]*protocol="grpc"[^}]*\} (\S+)', text)
    return round(sum(float(n) for n in counts))


def test_a_stream_whose_answers_are_not_read_is_read_no_further(endpoint: Endpoint) -> None:
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="features", datatype="FP32", shape=[1, 16])
    request.raw_input_contents.append(np.ones((1, 16), np.float32).tobytes())
    before = _answered(endpoint)
    # The raw client never sends a WINDOW_UPDATE for what it receives: the answers stop at its initial window.
    c = Connection.to(endpoint.address)
    try:
        c.read(0.2)
        stream = c.open(STREAM)
        c.send(stream, grpc_message(request.SerializeToString()) * SENT)
        wait_until(lambda: _answered(endpoint) - before >= STREAM_IN_FLIGHT, "the stream's first answers")
        # Until the count stops moving (a fixed point the bound makes: nothing is read, so nothing is answered), or
        # passes the bound; an upper bound only, so a slow host cannot fail it.
        seen, deadline = -1, time.monotonic() + 30
        while time.monotonic() < deadline:
            answered = _answered(endpoint) - before
            if answered == seen or answered > BOUND:
                break
            seen = answered
            time.sleep(1)
        assert answered <= BOUND, f"{answered} of {SENT} requests answered for a client that reads none"
        healthy(endpoint)  # other clients are served meanwhile
        assert stream not in c.ended
    finally:
        c.close()
