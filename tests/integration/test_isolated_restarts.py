"""Instance processes that die or hang, in-process app, real instance processes: readiness follows whether an instance
can serve, a request never gets a 500 for a restart, a request that kills its process fails alone and the process is
restarted at once, a request sent to a process already dead runs on the restarted one, a request whose deadline
passes while its batch waits for a restarting process is answered 504 (HTTP and gRPC) as in the queue while the rest of
its batch runs, a hung process is killed and restarted, requests during a restart's back-off are refused at once, and
a precision switch whose new process dies while starting fails as a load does."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import re
import select
import signal
import textwrap
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from tritonclient.grpc import service_pb2

from halfserve import store
from halfserve.execution import Batching
from halfserve.isolated import supervision
from halfserve.isolated.engine import ProcessEngine
from halfserve.isolated.wire import InstanceProcess
from halfserve.manifest import Manifest, TensorSpec
from tests.conftest import free_port
from tests.integration.conftest import serving
from tests.integration.test_faults import served
from tests.integration.test_isolated import AUTH, model, processes
from tests.waiting import DEADLINE_S

pytestmark = pytest.mark.slow

CRASH = 777.0

CODE = textwrap.dedent(
    """
    import os
    import time
    from pathlib import Path

    import torch
    from torch import nn

    GATE = Path({gate!r})
    DEATHS = Path({deaths!r})


    class Crashing(nn.Module):
        def __init__(self, in_features: int, out_features: int) -> None:
            super().__init__()
            self.linear = nn.Linear(in_features, out_features)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if (x == {crash}).any():
                with DEATHS.open("a") as f:
                    f.write(f"{{x.shape[0]}}\\n")
                os._exit(3)  # the process dies, as a segfault in a kernel would take it
            return self.linear(x)


    def build(in_features: int, out_features: int) -> nn.Module:
        # While the gate file exists, a starting process holds here: it stays "starting" for as long as a test needs.
        deadline = time.monotonic() + 120
        while GATE.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return Crashing(in_features, out_features)
    """
)


def save_crashing(root: Path, max_delay_ms: float = 2) -> tuple[Path, Path, Path]:
    """A linear model from the operator's code (``<module>:build``, the module ``code / "<module>.py"``) whose process
    dies on an input holding ``CRASH`` (noting the batch's rows in the deaths file) and whose start holds while the gate
    file exists. Returns the code path, the gate and the deaths file.

    The module's name is the test's own: this process keeps the first module it imports under a name, and each test's
    module names its own files."""
    code, gate, deaths = root / "code", root / "gate", root / "deaths"
    code.mkdir()
    (code / f"{module_name(root)}.py").write_text(CODE.format(gate=str(gate), deaths=str(deaths), crash=CRASH))
    module = torch.nn.Module()
    module.linear = torch.nn.Linear(4, 3)
    manifest = Manifest(
        name="crashing",
        architecture=f"{module_name(root)}:build",
        arch_kwargs={"in_features": 4, "out_features": 3},
        inputs=[TensorSpec(name="x", shape=[4])],
        outputs=[TensorSpec(name="y", shape=[3])],
        batching=Batching(max_batch_size=16, max_delay_ms=max_delay_ms),
    )
    store.save(root / "store", manifest, module)
    return code, gate, deaths


def dead(pid: int) -> bool:
    """Whether process ``pid`` has exited: gone, or a zombie its parent has not reaped yet (multiprocessing reaps a
    killed child at its next start, which may come before the child is a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("Z", "X")


def hung_up(instance: InstanceProcess) -> bool:
    """Whether ``instance``'s process closed its end of the socket (polled, not read: the reads are the server's)."""
    assert instance.transport is not None
    poller = select.poll()
    poller.register(instance.transport.get_extra_info("socket").fileno(), select.POLLRDHUP)
    return any(event & (select.POLLHUP | select.POLLRDHUP) for _, event in poller.poll(0))


def module_name(root: Path) -> str:
    return "crashing_" + re.sub(r"\W", "_", root.name)


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Return once ``check()`` holds; fail naming ``what`` past the deadline (a hang, not a slow host)."""
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        assert time.monotonic() < deadline, f"not within {DEADLINE_S:g} s: {what}"
        await asyncio.sleep(0.02)


async def pid_of(client: httpx.AsyncClient) -> int:
    [pid] = (await model(client, "crashing"))["stats"]["instance_pids"]  # type: ignore[index]
    assert isinstance(pid, int)
    return pid


async def replaced(client: httpx.AsyncClient, pid: int) -> int:
    """The pid of the process started in place of ``pid``, once there is one."""

    async def new() -> bool:
        return await pid_of(client) != pid

    await eventually(new, f"instance process {pid} replaced")
    return await pid_of(client)


async def not_ready(client: httpx.AsyncClient) -> None:
    r = await client.get("/ready")
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] == "1"
    assert "crashing (no instance able to serve" in r.json()["error"]
    r = await client.get("/v2/models/crashing/ready")
    assert r.status_code == 400, r.text
    r = await client.get("/v2/health/ready")
    assert r.status_code == 400, r.text


def predict(client: httpx.AsyncClient, value: float) -> Awaitable[httpx.Response]:
    return client.post("/predict", json={"inputs": [[1.0, 2.0, 3.0, value]]}, timeout=DEADLINE_S)


async def test_a_process_killed_while_restarting_never_fails_a_request_with_500_and_readiness_follows(
    tmp_path: Path,
) -> None:
    code, gate, _ = save_crashing(tmp_path)
    async with serving(processes(store=tmp_path / "store", code_path=[code], precision="fp32")) as client:
        first = await pid_of(client)
        gate.touch()  # every restart now holds while starting
        os.kill(first, signal.SIGKILL)
        second = await replaced(client, first)
        await not_ready(client)  # no instance can serve while its replacement starts
        waiting = [asyncio.ensure_future(predict(client, float(i))) for i in range(6)]
        await asyncio.sleep(0.2)  # let them reach the engine, where they wait for the restart
        os.kill(second, signal.SIGKILL)  # the replacement dies while starting
        third = await replaced(client, second)
        await not_ready(client)
        later = asyncio.ensure_future(predict(client, 9.0))  # sent while the third starts: waits for it
        gate.unlink()

        async def ready() -> bool:
            return (await client.get("/ready")).status_code == 200

        await eventually(ready, "ready again once the third process is warm")
        assert (await client.get("/v2/models/crashing/ready")).status_code == 200
        assert await pid_of(client) == third
        replies = await asyncio.gather(*waiting, later)
        for r in replies:  # waited for the restart, or told to send it again: never a 500
            assert r.status_code in (200, 503), r.text
            if r.status_code == 503:
                assert r.headers["Retry-After"] == "1"
                assert "no instance process able to serve" in r.json()["error"]
        assert replies[-1].status_code == 200
        assert (await predict(client, 1.0)).status_code == 200


async def test_a_deadline_passing_while_the_batch_waits_for_a_restarting_process_is_a_504_and_the_rest_runs(
    tmp_path: Path,
) -> None:
    code, gate, _ = save_crashing(tmp_path, max_delay_ms=10_000)  # a batch is cut once its 16 rows are queued
    port = free_port()
    settings = processes(
        store=tmp_path / "store", code_path=[code], precision="fp32", grpc=True, grpc_port=port, host="127.0.0.1"
    )
    async with serving(settings) as client, grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        first = await pid_of(client)
        gate.touch()  # every restart now holds while starting
        os.kill(first, signal.SIGKILL)
        await replaced(client, first)
        batcher = served(client, "crashing").batcher
        assert batcher is not None

        async def queued(n: int, what: str) -> None:
            async def check() -> bool:
                return batcher.queued_rows == n

            await eventually(check, what)

        rows = [[1.0, 2.0, 3.0, float(i)] for i in range(4)]
        plain = asyncio.ensure_future(client.post("/predict", json={"inputs": rows}, timeout=DEADLINE_S))
        await queued(4, "the request without a deadline queued")
        body = {
            "inputs": [{"name": "x", "shape": [4, 4], "datatype": "FP32", "data": sum(rows, [])}],
            "parameters": {"timeout": 3_000_000},
        }
        v2 = asyncio.ensure_future(client.post("/v2/models/crashing/infer", json=body, timeout=DEADLINE_S))
        await queued(8, "the V2 request queued")
        request = service_pb2.ModelInferRequest(model_name="crashing")
        request.inputs.add(name="x", datatype="FP32", shape=[4, 4]).contents.fp32_contents.extend(sum(rows, []))
        request.parameters["timeout"].int64_param = 3_000_000
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=service_pb2.ModelInferRequest.SerializeToString,
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        over_grpc = asyncio.ensure_future(infer(request, timeout=DEADLINE_S))
        await queued(12, "the gRPC request queued")
        headers = {"X-Request-Timeout-Ms": "3000"}
        timed = client.post("/predict", json={"inputs": rows}, headers=headers, timeout=DEADLINE_S)
        # Its rows fill the batch, cut at once and handed to the engine, which holds it for the restarting process.
        answers = await asyncio.gather(timed, v2)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await over_grpc
        assert batcher.stats.queued_chunks == 4  # all four were cut into the batch: none expired in the queue
        for r in answers:  # at their deadlines: no process had taken the batch, so it had not started
            assert r.status_code == 504, r.text
            assert r.json()["error"] == "deadline passed while the request was queued"
        assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert refused.value.details() == "deadline passed while the request was queued"
        assert not plain.done()
        await not_ready(client)  # answered while the process was still starting
        gate.unlink()
        r = await plain  # the rest of the batch ran once the process was up
        assert r.status_code == 200, r.text
        assert len(r.json()["outputs"]) == 4
        assert (await model(client, "crashing"))["stats"]["instance_restarts"] == 1  # type: ignore[index]


async def test_a_request_that_kills_its_process_fails_alone_and_the_process_restarts_at_once(tmp_path: Path) -> None:
    code, _, deaths = save_crashing(tmp_path, max_delay_ms=200)  # the eight requests make one batch
    async with serving(processes(store=tmp_path / "store", code_path=[code], precision="fp32")) as client:
        first = await pid_of(client)
        values = [float(i) for i in range(8)]
        values[2] = CRASH
        replies = await asyncio.gather(*(predict(client, v) for v in values))
        assert [r.status_code for r in replies] == [200, 200, 500, 200, 200, 200, 200, 200]
        assert "exited" in replies[2].json()["error"]
        # The batch that killed the process was rerun a request at a time, not in halves (whose half holding the
        # killer would kill each restarted process again): the killer ran alone once more, and was not retried.
        died_with = [int(n) for n in deaths.read_text().split()]
        assert died_with[-1] == 1
        assert died_with.count(1) == 1
        assert len(died_with) <= 2
        assert dead(first)
        # A process killed by a request is no start-up crash loop: killed again and again, it is restarted at once
        # each time (the start-up backoff, 0.5 s then 2, 10 and 30 s, would hold these requests for 42 s).
        for _ in range(4):
            r = await predict(client, CRASH)
            assert r.status_code == 500, r.text
        stats = (await model(client, "crashing"))["stats"]
        assert stats["instance_restarts"] == len(died_with) + 4  # type: ignore[index]
        assert stats["instance_start_failures"] == 0  # type: ignore[index]
        assert (await predict(client, 1.0)).status_code == 200


async def test_a_request_sent_to_a_process_killed_before_its_end_is_seen_is_run_on_the_restarted_one(
    tmp_path: Path,
) -> None:
    code, _, deaths = save_crashing(tmp_path)
    async with serving(processes(store=tmp_path / "store", code_path=[code], precision="fp32")) as client:
        first = await pid_of(client)
        engine = served(client, "crashing").engine
        assert isinstance(engine, ProcessEngine)
        [instance] = engine.instances
        assert instance.transport is not None
        # Its socket unread, the server does not see the process end (as in the moments after the OOM killer's
        # SIGKILL): the batch below goes to it, and finds it dead.
        instance.transport.pause_reading()
        os.kill(first, signal.SIGKILL)

        async def gone() -> bool:
            # Its pid may show a zombie while its other threads still hold the socket: its end is the socket's.
            return hung_up(instance)

        await eventually(gone, f"instance process {first} gone and its socket closed")
        r = await predict(client, 1.0)
        # The process never took the batch: no request of it killed the process, and it runs on the restarted one.
        assert r.status_code == 200, r.text
        assert await pid_of(client) != first
        assert not deaths.exists()
        stats = (await model(client, "crashing"))["stats"]
        assert stats["instance_restarts"] == 1  # type: ignore[index]
        assert stats["failed_batches"] == 0  # type: ignore[index]


async def test_a_hung_process_is_killed_by_the_watchdog_and_its_requests_answered_by_the_restarted_one(
    tmp_path: Path,
) -> None:
    code, _, _ = save_crashing(tmp_path)
    # A batch of this model takes milliseconds; 3 s is far past that on any host, and short for the test to wait out.
    settings = processes(store=tmp_path / "store", code_path=[code], precision="fp32", instance_batch_timeout=3.0)
    async with serving(settings) as client:
        first = await pid_of(client)
        os.kill(first, signal.SIGSTOP)  # hung: alive, its socket open, never answering
        try:
            replies = await asyncio.gather(*(predict(client, float(i)) for i in range(3)))
        finally:
            if not dead(first):
                os.kill(first, signal.SIGKILL)
        # The watchdog killed it; the batch, which it never took, ran on the restarted process.
        assert [r.status_code for r in replies] == [200] * 3, [r.text for r in replies]
        assert dead(first)
        assert await pid_of(client) != first
        assert (await client.get("/ready")).status_code == 200
        stats = (await model(client, "crashing"))["stats"]
        assert stats["instance_restarts"] == 1  # type: ignore[index]


async def test_while_every_process_waits_out_its_back_off_requests_get_a_503_at_once_with_the_time_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(supervision, "RESPAWN_DELAYS_S", (600.0,))  # far longer than the test: it never ends here
    code, gate, _ = save_crashing(tmp_path)
    async with serving(processes(store=tmp_path / "store", code_path=[code], precision="fp32")) as client:
        first = await pid_of(client)
        gate.touch()  # every restart now holds while starting
        os.kill(first, signal.SIGKILL)
        second = await replaced(client, first)
        waiting = asyncio.ensure_future(predict(client, 1.0))  # waits for the restart, or is refused as below
        await asyncio.sleep(0.2)  # let it reach the engine
        os.kill(second, signal.SIGKILL)  # the restart dies while starting: 600 s of back-off
        failed = f"a restart failed: instance process 0 of model 'crashing' (pid {second}) exited before it was ready"
        for r in (await waiting, await predict(client, 2.0), await predict(client, 3.0)):
            # Told when to come back, rather than held until the client gives up.
            assert r.status_code == 503, r.text
            assert 300 <= int(r.headers["Retry-After"]) <= 600  # the back-off left, not the default 1 (a slow host)
            assert r.json()["error"].startswith(f"model 'crashing' has no instance process able to serve ({failed}; ")
            assert "the next start in " in r.json()["error"]
        await not_ready(client)
        stats = (await model(client, "crashing"))["stats"]
        assert stats["instance_start_failures"] == 1  # type: ignore[index]


async def test_a_switch_whose_new_process_dies_while_starting_fails_as_a_load_and_the_old_engine_serves_on(
    tmp_path: Path,
) -> None:
    code, gate, _ = save_crashing(tmp_path)
    async with serving(processes(store=tmp_path / "store", code_path=[code], precision="fp32")) as client:
        old = await pid_of(client)
        gate.touch()  # the switch's new process holds while starting
        switch = asyncio.ensure_future(
            client.post("/models/crashing/precision", json={"precision": "bf16"}, headers=AUTH, timeout=DEADLINE_S)
        )
        new: list[int] = []

        async def started() -> bool:
            new[:] = [p.pid for p in multiprocessing.active_children() if p.name == "halfserve-crashing-0"]
            new[:] = [p for p in new if p != old]
            return bool(new)

        await eventually(started, "the switch's new instance process started")
        os.kill(new[0], signal.SIGKILL)
        r = await switch
        assert r.status_code == 400, r.text
        assert r.json()["error"] == (
            f"failed to load 'crashing' in bf16: instance process 0 of model 'crashing' (pid {new[0]}) exited before "
            "it was ready; it goes on serving in fp32"
        )
        gate.unlink()
        listing = await model(client, "crashing")
        assert listing["precision"] == "fp32"
        assert await pid_of(client) == old
        r = await predict(client, 1.0)
        assert (r.status_code, r.json()["precision"]) == (200, "fp32")
        assert (await client.get("/ready")).status_code == 200
