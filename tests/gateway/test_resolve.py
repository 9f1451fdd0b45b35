"""Which model version a request goes to, and what a version that is not served answers."""

from __future__ import annotations

import pytest

from sluice import wire
from sluice.clock import VirtualClock
from sluice.errors import ModelNotFound, ModelNotReady
from sluice.gateway.gateway import Gateway
from sluice.metrics import GatewayMetrics

INFO = wire.ModelInfo("m", "1", "emulated", "p", (), (), 32, 1.0, False, True)


def test_a_repository_version_still_loading_is_503_and_an_unknown_one_404(monkeypatch):
    gateway = Gateway(VirtualClock(), GatewayMetrics())
    monkeypatch.setattr(gateway.catalog, "models", lambda **_: {"m": {"1": INFO}})  # version 1 ready, 2 loading
    gateway.expected_versions = {("m", "1"), ("m", "2")}
    assert gateway.resolve("m", "1") is INFO
    with pytest.raises(ModelNotReady, match="version '2'") as not_ready:
        gateway.resolve("m", "2")
    assert not_ready.value.retry_after_s > 0
    with pytest.raises(ModelNotFound, match="no version '3'"):
        gateway.resolve("m", "3")
