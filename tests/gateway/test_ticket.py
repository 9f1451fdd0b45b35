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
from sluice.gateway.ticket import InferResult, interpret
from sluice.metrics import GatewayMetrics
from sluice.priority import Priority

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


async def test_a_deferred_ticket_counts_and_settles_only_once_its_accounting_runs():
    """Within `defer_accounting` (the task writing a one-shot HTTP answer), a closed ticket's
    metrics and local settlement wait for `run_deferred`, and its latency is as of its close."""
    from prometheus_client import REGISTRY

    from sluice.gateway.limits import Reservation
    from sluice.gateway.ticket import Ticket, defer_accounting, run_deferred
    from sluice.priority import Priority

    clock = VirtualClock()
    metrics = GatewayMetrics()
    tenancy = Tenancy(clock, metrics)
    info = wire.ModelInfo("deferred", "1", "emulated", "p", (), (), 32, 1.0, False, True)
    labels = {"model": "deferred", "version": "1", "outcome": "ok"}
    settled: list[float] = []
    tenancy.limiter.settle = lambda reservation, tokens, device_s, refund_request=False: settled.append(device_s)  # type: ignore[method-assign]

    deferred = defer_accounting()
    ticket = Ticket(metrics, tenancy, clock, info, "", Priority.STANDARD, Reservation("", 0.0, ()), 0.0, 1.0)
    async with ticket:
        ticket.charge(3, 0.25)
        ticket.done(InferResult(info, wire.TensorPayload("float32", (1,), b"\0\0\0\0"), 3, 0.0, 0.01, 1, 0.25))
    clock.advance(5.0)  # the accounting runs later: the request's latency is still 0
    assert REGISTRY.get_sample_value("sluice_requests_total", labels) is None and settled == []
    run_deferred(deferred)
    assert REGISTRY.get_sample_value("sluice_requests_total", labels) == 1.0
    assert REGISTRY.get_sample_value("sluice_request_duration_seconds_sum", {**labels}) == 0.0
    assert settled == [0.25] and deferred == []


async def test_without_deferral_a_ticket_settles_as_it_closes():
    from sluice.gateway.limits import Reservation
    from sluice.gateway.ticket import Ticket

    clock = VirtualClock()
    metrics = GatewayMetrics()
    tenancy = Tenancy(clock, metrics)
    settled: list[float] = []
    tenancy.limiter.settle = lambda reservation, tokens, device_s, refund_request=False: settled.append(device_s)  # type: ignore[method-assign]
    info = wire.ModelInfo("inline", "1", "emulated", "p", (), (), 32, 1.0, False, True)
    ticket = Ticket(metrics, tenancy, clock, info, "", Priority.STANDARD, Reservation("", 0.0, ()), 0.0, 1.0)
    async with ticket:
        ticket.charge(1, 0.5)
    assert settled == [0.5]
