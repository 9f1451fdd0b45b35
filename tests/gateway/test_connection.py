"""What a gateway counts for a worker between its reports: the work it has sent since, per
tenant and class, which early admission adds to the worker's reported wait."""

from __future__ import annotations

import asyncio
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client import REGISTRY

from sluice import wire
from sluice.clock import VirtualClock
from sluice.errors import InvalidInput, Overloaded
from sluice.gateway.admission import excess_s, tenant_wait_s
from sluice.gateway.connection import WorkerConnection
from sluice.gateway.gateway import Gateway
from sluice.gateway.ticket import interpret
from sluice.metrics import GatewayMetrics
from sluice.priority import Priority
from sluice.transport import Listener


def _state(tenant_wait_s: float, seen_request_id: int = 0, newcomer_s: float = 0.0,
           is_provisional: bool = False) -> wire.WorkerState:
    info = wire.ModelInfo("m", "1", "emulated", "p", (), (), 32, 0.27, False, False)
    return wire.WorkerState("w", "i", True, False, [info], [],
                            [wire.QueueState("m", "1", 10, 0.5, 0.01, newcomer_s, is_provisional)],
                            work_ahead_s=0.5, drain_rate=0.5,
                            waits=[wire.WaitState(1, tenant_wait_s, "a"), wire.WaitState(1, 0.1)],
                            seen_request_id=seen_request_id)


class _RecordingChannel:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def send(self, data: bytes) -> bool:
        self.frames.append(data)
        return True

    async def aclose(self) -> None:
        pass


def _connection(channel: _RecordingChannel | None = None) -> WorkerConnection:
    """A connection whose frames are recorded instead of sent (it counts as connected)."""
    connection = WorkerConnection("w", "ipc:///nonexistent/sluice-test.sock", "g")
    connection._channel = channel or _RecordingChannel()  # type: ignore[assignment]
    return connection


def _submit(request_id: int, tenant: str) -> wire.Submit:
    payload = wire.TensorPayload("float32", (1, 16), bytes(64))
    return wire.Submit(request_id, "m", "1", payload, 1.0, tenant, int(Priority.STANDARD))


def test_sent_work_counts_per_flow_until_the_next_report() -> None:
    async def scenario() -> None:
        connection = _connection()
        state = _state(0.2)
        connection._on_message(state)
        for request_id, tenant in ((1, "a"), (2, "a"), (3, "b")):
            assert connection.submit(_submit(request_id, tenant)) is not None
        assert connection.sent_flow_work_s("a", 1) == pytest.approx(0.02)
        assert connection.sent_flow_work_s("b", 1) == pytest.approx(0.01)
        assert connection.predicted_wait_s == pytest.approx(0.5 + 0.03)
        info = state.models[0]
        # tenant a's new request queues behind its reported work and what was sent since (at drain 0.5);
        # the report's time is set just before each check, so a slow test machine cannot age it
        connection.state_at = time.monotonic()
        assert tenant_wait_s(connection, "a", Priority.STANDARD, info) == pytest.approx(0.2 + 0.02 / 0.5,
                                                                                                 abs=0.005)
        # the device has been working since the report: that much of the reported wait is gone
        connection.state_at = time.monotonic() - 0.15
        assert tenant_wait_s(connection, "a", Priority.STANDARD, info) == pytest.approx(0.05 + 0.02 / 0.5,
                                                                                                 abs=0.005)
        connection._on_message(_state(0.25))  # the next report includes them
        assert connection.sent_flow_work_s("a", 1) == 0.0
        assert connection.predicted_wait_s == pytest.approx(0.5)

    asyncio.run(scenario())


def test_a_report_drops_only_the_work_the_worker_had_received_when_it_built_it() -> None:
    """A report that arrives late must not forget requests sent after the worker built it."""
    async def scenario() -> None:
        connection = _connection()
        connection._on_message(_state(0.2, seen_request_id=0))
        for request_id in range(1, 6):
            assert connection.submit(_submit(request_id, "a")) is not None
        assert connection.sent_flow_work_s("a", 1) == pytest.approx(0.05)
        connection._on_message(_state(0.25, seen_request_id=3))  # built when 1-3 had arrived
        assert connection.sent_flow_work_s("a", 1) == pytest.approx(0.02)
        # request 5 is answered (refused at once, say) before any report counts it
        connection._on_message(wire.Result(5, wire.Outcome.REJECTED, retry_after_s=0.1))
        assert connection.sent_flow_work_s("a", 1) == pytest.approx(0.01)
        connection._on_message(_state(0.25, seen_request_id=5))
        assert connection.sent_flow_work_s("a", 1) == 0.0
        assert connection.sent_work_since_state_s == 0.0

    asyncio.run(scenario())


def test_early_admission_counts_the_newcomers_own_batch() -> None:
    """The gateway refuses at once a request whose wait plus its own batch would end past its
    deadline (the worker would refuse it after a round trip), but leaves to the worker one whose
    own batch alone would miss it (a deadline too short: the worker answers 504, not 503)."""
    async def scenario() -> None:
        connection = _connection()
        state = _state(0.2, newcomer_s=0.03)
        connection._on_message(state)
        info = state.models[0]
        excess = excess_s(connection, "a", Priority.STANDARD, info, 10.0, 10.0 + 0.22)
        assert excess == pytest.approx(0.01, abs=0.002)  # 0.2 wait + 0.03 own, 0.22 allowed
        assert excess_s(connection, "a", Priority.STANDARD, info, 10.0, 10.0 + 0.24) == 0.0
        assert excess_s(connection, "a", Priority.STANDARD, info, 10.0, 10.0 + 0.02) == 0.0

    asyncio.run(scenario())


def test_early_admission_leaves_a_model_with_provisional_predictions_to_its_worker() -> None:
    """A fresh worker whose warm-up ran on a busy host predicts far too slow: the gateway does not
    refuse on its predictions; the worker, which lets its first batches correct them, decides."""
    async def scenario() -> None:
        connection = _connection()
        state = _state(0.2, newcomer_s=0.03, is_provisional=True)
        connection._on_message(state)
        assert excess_s(connection, "a", Priority.STANDARD, state.models[0], 10.0, 10.0 + 0.22) == 0.0
        connection._on_message(_state(0.2, newcomer_s=0.03))  # its batches have corrected them
        assert excess_s(connection, "a", Priority.STANDARD, state.models[0], 10.0, 10.0 + 0.22) > 0.0

    asyncio.run(scenario())


def test_an_unencodable_request_fails_alone_and_the_others_are_sent_at_once() -> None:
    """A seed beyond 64 bits cannot be encoded: that request gets a 400, while the requests and
    cancels around it reach the worker, each as it is sent (not at the end of the loop turn)."""
    async def scenario() -> None:
        channel = _RecordingChannel()
        connection = _connection(channel)
        connection._on_message(_state(0.0))
        first = connection.submit(_generate(1))
        assert first is not None and len(channel.frames) == 1  # written before the loop turns
        bad = connection.submit(_generate(2, seed=2**64))
        second = connection.submit(_generate(3))
        connection.cancel(1)
        assert bad is not None and second is not None
        sent = [message for frame in channel.frames for message in wire.decode(frame)]
        assert [(type(m).__name__, getattr(m, "request_id", None)) for m in sent] == [
            ("Submit", 1), ("Submit", 3), ("Cancel", None)]
        result = await bad.future
        assert result is not None
        with pytest.raises(InvalidInput, match="could not be sent"):
            interpret(_state(0.0).models[0], result)
        assert not second.future.done()

    asyncio.run(scenario())


def test_a_request_the_worker_cannot_take_now_is_not_left_in_flight() -> None:
    """Not connected at the moment of sending: `submit` says so (the gateway retries), and nothing
    of the request stays counted as sent."""
    async def scenario() -> None:
        connection = WorkerConnection("w", "ipc:///nonexistent/sluice-test.sock", "g")  # never connected
        connection._on_message(_state(0.0))
        assert connection.submit(_generate(1)) is None
        assert connection.sent_flow_work_s("a", int(Priority.STANDARD)) == 0.0
        assert not connection._in_flight

    asyncio.run(scenario())


def _generate(request_id: int, seed: int | None = None) -> wire.Submit:
    payload = wire.GeneratePayload(prompt="hi", seed=seed)
    return wire.Submit(request_id, "m", "1", payload, 1.0, "a", int(Priority.STANDARD))


def test_a_worker_leaving_the_registry_answers_what_it_has_before_its_report_says_draining() -> None:
    """The registry can show a draining worker gone before its next report says it drains: its
    requests must still be answered, and it must be sent nothing new meanwhile."""
    async def scenario() -> None:
        gateway = Gateway(VirtualClock(), GatewayMetrics())
        connection = _connection()
        gateway._connections["w"] = connection
        connection._on_message(_state(0.0))  # ready, not (yet) reported draining
        assert connection.is_ready
        in_flight = connection.submit(_submit(1, "a"))
        assert in_flight is not None
        removal = asyncio.create_task(gateway.remove_worker("w"))
        await asyncio.sleep(0.1)
        assert not removal.done() and not connection.is_ready
        connection._on_message(_state(0.0))  # a report from before the drain: still nothing new
        assert not connection.is_ready
        connection._on_message(wire.Result(1, wire.Outcome.OK))
        await asyncio.wait_for(removal, 1.0)
        assert (await in_flight.future) is not None and in_flight.future.result().outcome is wire.Outcome.OK
        assert "w" not in gateway._connections

    asyncio.run(scenario())


async def _listening(address: str, state: wire.WorkerState | None = None) -> tuple[Listener, WorkerConnection,
                                                                                      list[bytes]]:
    """A worker's listener at `address` and a gateway's connection to it, once the connection has
    reached it; with `state`, once the gateway has that report too. Also the peers it heard from."""
    peers: list[bytes] = []
    listener = await Listener.start(address, lambda identity, frame: peers.append(identity))
    connection = WorkerConnection("w", address, "g")
    await connection.start()
    async with asyncio.timeout(5):
        while not peers:
            await asyncio.sleep(0.01)
    if state is not None:
        listener.send(peers[-1], wire.encode_many([state]))
        async with asyncio.timeout(5):
            while connection.state is None:
                await asyncio.sleep(0.01)
    return listener, connection, peers


def test_a_request_on_its_way_to_a_worker_that_drained_and_closed_is_freed_at_once(tmp_path: Path) -> None:
    """A draining worker closes once it has answered what it took; a request that reached its
    socket after that is resolved as lost (not started: the gateway sends it elsewhere) when the
    connection closes, not after the worker's reports have been missing for seconds."""
    async def scenario() -> None:
        draining = msgspec.structs.replace(_state(0.0), is_ready=False, is_draining=True)
        listener, connection, _ = await _listening(f"ipc://{tmp_path}/w.sock", draining)
        in_flight = connection.submit(_submit(1, "a"))
        assert in_flight is not None
        started = time.monotonic()
        await listener.aclose()  # the worker exits without reading it
        assert await asyncio.wait_for(in_flight.future, 1.5) is None
        assert not in_flight.is_started and time.monotonic() - started < 1.5  # silence counts after 2 s
        await connection.aclose()

    asyncio.run(scenario())


def test_a_request_refused_before_it_is_sent_counts_the_work_of_all_its_items() -> None:
    """The refused demand (what autoscaling reads) of a 4-row request is 4 rows' work, not one's."""
    async def scenario() -> None:
        gateway = Gateway(VirtualClock(), GatewayMetrics())
        connection = _connection()
        gateway._connections["w"] = connection
        connection._on_message(_state(5.0))  # tenant a's work queued: 5 s
        connection.state_at = time.monotonic()
        info = connection.state.models[0]
        ticket = SimpleNamespace(tenant="a", priority=Priority.STANDARD, deadline=1.0)
        labels = {"model": "m", "version": "1"}
        before = REGISTRY.get_sample_value("sluice_refused_work_seconds_total", labels) or 0.0
        payload = wire.TensorPayload("float32", (4, 16), bytes(256))
        with pytest.raises(Overloaded):
            gateway._dispatcher.choose(info, ticket, payload)  # type: ignore[arg-type]
        refused_s = (REGISTRY.get_sample_value("sluice_refused_work_seconds_total", labels) or 0.0) - before
        assert refused_s == pytest.approx(4 * 0.01)  # the report's 10 ms per item

    asyncio.run(scenario())


def test_a_worker_restarted_at_its_address_before_its_silence_shows_loses_what_the_old_one_had(
        tmp_path: Path) -> None:
    """A worker killed and started again at the same address within STALE_AFTER_S (a fast
    restart by systemd, or a proxy in front of it): the new process's report comes before the
    old one's silence counts, and the requests the old one had used to wait for their deadlines
    (then 504). They are lost as soon as another incarnation reports: one it had started (503 at
    the gateway), one it had not (sent again). A request sent to the new process is kept, and so
    is everything after a reconnection to the same process."""
    async def scenario() -> None:
        address = f"ipc://{tmp_path}/w.sock"
        old, connection, peers = await _listening(address, msgspec.structs.replace(_state(0.0), incarnation="one"))
        started, waiting = connection.submit(_submit(1, "a")), connection.submit(_submit(2, "a"))
        assert started is not None and waiting is not None
        old.send(peers[-1], wire.encode_many([wire.Started([1])]))
        async with asyncio.timeout(5):
            while not started.is_started:
                await asyncio.sleep(0.01)

        async def replace(listener: Listener) -> Listener:
            """Close `listener`; another takes the address, and is returned once the gateway has
            reconnected to it."""
            await listener.aclose()
            known = len(peers)
            new = await Listener.start(address, lambda identity, frame: peers.append(identity))
            async with asyncio.timeout(1.5):  # within STALE_AFTER_S of the last report
                while len(peers) == known or not connection._channel.is_connected:
                    await asyncio.sleep(0.01)
            return new

        same = await replace(old)  # a blip: the same process answers again
        blip_request = connection.submit(_submit(3, "a"))
        same.send(peers[-1], wire.encode_many([msgspec.structs.replace(_state(0.0), incarnation="one")]))
        await asyncio.sleep(0.2)
        assert not started.future.done() and not waiting.future.done()

        new = await replace(same)
        fresh = connection.submit(_submit(4, "a"))
        assert fresh is not None and blip_request is not None
        new.send(peers[-1], wire.encode_many([msgspec.structs.replace(_state(0.0), incarnation="two")]))
        assert await asyncio.wait_for(started.future, 1.0) is None and started.is_started
        assert await asyncio.wait_for(waiting.future, 1.0) is None and not waiting.is_started
        assert await asyncio.wait_for(blip_request.future, 1.0) is None  # sent to "one" too
        assert not fresh.future.done()  # sent to "two", which has it
        assert connection.num_in_flight == 1 and connection.is_ready
        await connection.aclose()
        await new.aclose()

    asyncio.run(scenario())


def test_requests_on_a_worker_that_died_are_freed_once_its_address_refuses_connections() -> None:
    """A worker on another host killed with SIGKILL (not draining): its connection closes, and
    nothing listens at its address any more. What it had is lost at once (its started request
    503, the other sent elsewhere), where it waited STALE_AFTER_S (2 s) of silence first, past
    the deadlines of most requests."""
    async def scenario() -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            address = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
        listener, connection, peers = await _listening(address)
        started, waiting = connection.submit(_submit(1, "a")), connection.submit(_submit(2, "a"))
        assert started is not None and waiting is not None
        listener.send(peers[0], wire.encode_many([_state(0.0), wire.Started([1])]))
        async with asyncio.timeout(5):
            while not started.is_started:
                await asyncio.sleep(0.01)
        await listener.aclose()  # the process is gone, and its port with it
        assert await asyncio.wait_for(started.future, 1.0) is None and started.is_started
        assert await asyncio.wait_for(waiting.future, 1.0) is None and not waiting.is_started
        assert not connection.is_ready and connection.num_in_flight == 0
        await connection.aclose()

    asyncio.run(scenario())
