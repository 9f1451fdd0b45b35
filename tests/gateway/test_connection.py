"""What a gateway counts for a worker between its reports: the work it has sent since, per
tenant and class, which early admission adds to the worker's reported wait."""

from __future__ import annotations

import asyncio

import pytest

from sluice import wire
from sluice.gateway.connection import WorkerConnection
from sluice.gateway.gateway import Gateway
from sluice.priority import Priority


def _state(tenant_wait_s: float) -> wire.WorkerState:
    info = wire.ModelInfo("m", "1", "emulated", "p", (), (), 32, 0.27, False, False)
    return wire.WorkerState("w", "i", True, False, [info], [], [wire.QueueState("m", "1", 10, 0.5, 0.01)],
                            work_ahead_s=0.5, drain_rate=0.5,
                            waits=[wire.WaitState(1, tenant_wait_s, "a"), wire.WaitState(1, 0.1)])


def _submit(request_id: int, tenant: str) -> wire.Submit:
    payload = wire.TensorPayload("float32", (1, 16), bytes(64))
    return wire.Submit(request_id, "m", "1", payload, 1.0, tenant, int(Priority.STANDARD))


def test_sent_work_counts_per_flow_until_the_next_report() -> None:
    async def scenario() -> None:
        connection = WorkerConnection("w", "ipc:///nonexistent/sluice-test.sock", "g")
        state = _state(0.2)
        connection._on_message(state)
        for request_id, tenant in ((1, "a"), (2, "a"), (3, "b")):
            assert connection.submit(_submit(request_id, tenant)) is not None
        assert connection.sent_flow_work_s("a", 1) == pytest.approx(0.02)
        assert connection.sent_flow_work_s("b", 1) == pytest.approx(0.01)
        assert connection.predicted_wait_s == pytest.approx(0.5 + 0.03)
        info = state.models[0]
        # tenant a's new request queues behind its reported work and what was sent since (at drain 0.5)
        assert Gateway._tenant_wait_s(connection, "a", Priority.STANDARD, info) == pytest.approx(0.2 + 0.02 / 0.5,
                                                                                                 abs=0.005)
        # the device has been working since the report: that much of the reported wait is gone
        connection.state_at -= 0.15
        assert Gateway._tenant_wait_s(connection, "a", Priority.STANDARD, info) == pytest.approx(0.05 + 0.02 / 0.5,
                                                                                                 abs=0.005)
        connection._on_message(_state(0.25))  # the next report includes them
        assert connection.sent_flow_work_s("a", 1) == 0.0
        assert connection.predicted_wait_s == pytest.approx(0.5)

    asyncio.run(scenario())
