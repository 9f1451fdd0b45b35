"""Admission and routing for a model served by an upstream server read that upstream's reported
slot wait, not the worker's device queue."""

from __future__ import annotations

from sluice import wire
from sluice.gateway.admission import predicted_wait_s
from sluice.priority import Priority


def _info(name: str, kind: str) -> wire.ModelInfo:
    return wire.ModelInfo(name, "1", kind, "p", (), (), 1, 1.0, False, False)


def _state(**loads: list[float]) -> wire.WorkerState:
    upstreams = [wire.UpstreamLoad(name, "1", 2, 5, 2, waits, 0.5) for name, waits in loads.items()]
    return wire.WorkerState("w", "i", True, False, [], [], [], work_ahead_s=9.0, drain_rate=1.0, upstreams=upstreams)


def test_an_upstream_model_waits_for_its_slot_by_class():
    state = _state(proxy=[0.5, 2.0, 3.0])
    proxy = _info("proxy", "openai-upstream")
    assert predicted_wait_s(state, "", Priority.INTERACTIVE, proxy) == 0.5
    assert predicted_wait_s(state, "", Priority.BATCH, proxy) == 3.0


def test_a_device_model_on_the_same_worker_still_waits_for_the_device():
    state = _state(proxy=[0.5, 2.0, 3.0])
    assert predicted_wait_s(state, "", Priority.STANDARD, _info("local", "emulated")) == 9.0
    assert predicted_wait_s(state, "", Priority.STANDARD, _info("other", "openai-upstream")) == 0.0
