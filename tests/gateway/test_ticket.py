"""How the gateway reads a worker's answer (`interpret`) and refuses early (`shed_if_overloaded`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice import wire
from sluice.clock import VirtualClock
from sluice.errors import DeviceFailed, InvalidInput, ItemFailed, PermissionDenied, WorkerLost
from sluice.gateway import Caller, Gateway
from sluice.gateway.keyfile import add_key
from sluice.gateway.tenancy import Tenancy
from sluice.gateway.ticket import interpret
from sluice.metrics import GatewayMetrics

INFO = wire.ModelInfo("m", "1", "generative", "p", (), (), 32, 1.0, True, False)


def test_a_device_failure_of_a_whole_request_is_503_not_the_clients_fault():
    failed = wire.Result(1, wire.Outcome.FAILED, message="x",
                         errors=[wire.ItemError(-1, "the model failed while generating", is_transient=True)])
    with pytest.raises(DeviceFailed):  # a 503, counted as outcome "failed"
        interpret(INFO, failed)


def test_a_whole_request_the_worker_could_not_take_is_400():
    refused = wire.Result(1, wire.Outcome.FAILED, message="x", errors=[wire.ItemError(-1, "prompt too long")])
    with pytest.raises(InvalidInput):
        interpret(INFO, refused)


def test_the_early_overload_check_answers_a_forbidden_model_with_403(tmp_path: Path):
    path = tmp_path / "tenants.toml"
    path.write_text("[tenants.a]\nmodels = ['other']\n")
    add_key(path, "a")
    clock = VirtualClock()
    metrics = GatewayMetrics()
    gateway = Gateway(clock, metrics, tenancy=Tenancy(clock, metrics, path))
    with pytest.raises(PermissionDenied):
        gateway.shed_if_overloaded(INFO, None, 0.0, Caller("a"))


@pytest.mark.parametrize("error, outcome", [(ItemFailed("item 0: NaN"), "invalid"),
                                            (DeviceFailed("the device failed"), "failed"),
                                            (WorkerLost("worker 0 died"), "failed")])
async def test_a_clients_mistake_is_counted_apart_from_our_failures(error: Exception, outcome: str):
    from prometheus_client import REGISTRY

    from sluice.gateway.limits import Reservation
    from sluice.gateway.ticket import Ticket
    from sluice.priority import Priority

    clock = VirtualClock()
    metrics = GatewayMetrics()
    labels = {"model": "outcomes", "version": "1", "outcome": outcome}
    before = REGISTRY.get_sample_value("sluice_requests_total", labels) or 0.0
    info = wire.ModelInfo("outcomes", "1", "emulated", "p", (), (), 32, 1.0, False, True)
    ticket = Ticket(metrics, Tenancy(clock, metrics), clock, info, "", Priority.STANDARD,
                    Reservation("", 0.0, ()), 0.0, 1.0)
    with pytest.raises(type(error)):
        async with ticket:
            raise error
    assert REGISTRY.get_sample_value("sluice_requests_total", labels) == before + 1
