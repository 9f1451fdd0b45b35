"""Which requests a model's shadow copies, and how a copy's answer is compared (`gateway.shadow`)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from sluice import wire
from sluice.gateway.shadow import Shadow, Shadows, same_answer


def _tensor(values: list[float], dtype: str = "float32") -> wire.TensorPayload:
    array = np.asarray(values, dtype=dtype)
    return wire.TensorPayload(dtype, array.shape, array.tobytes())


def test_a_shadow_copies_requests_routed_to_other_versions_only() -> None:
    shadows = Shadows()
    rng = random.Random(1)
    assert shadows.target("m", "1", rng) is None  # no shadow: nothing copied
    shadows.start("m", Shadow("2"))
    assert shadows.target("m", "1", rng) == "2"
    assert shadows.target("m", "2", rng) is None  # routed there anyway: no copy
    assert shadows.target("other", "1", rng) is None
    assert shadows.stop("m") == Shadow("2")
    assert shadows.target("m", "1", rng) is None


def test_a_shadow_copies_about_its_share() -> None:
    shadows = Shadows()
    shadows.start("m", Shadow("2", 0.1))
    rng = random.Random(7)
    copied = sum(shadows.target("m", "1", rng) == "2" for _ in range(10_000))
    assert 850 <= copied <= 1150


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan"), float("inf"), True])
def test_a_share_outside_zero_to_one_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match="share"):
        Shadows().start("m", Shadow("2", share))


def test_answers_are_the_same_within_a_small_relative_tolerance() -> None:
    assert same_answer(_tensor([1.0, 2.0]), _tensor([1.0, 2.0])) is True
    assert same_answer(_tensor([1000.0, 2.0]), _tensor([1000.3, 2.0001])) is True
    assert same_answer(_tensor([1.0, 2.0]), _tensor([1.0, 2.1])) is False
    assert same_answer(_tensor([1.0, 2.0]), _tensor([1.0, 2.0, 3.0])) is False  # another shape
    assert same_answer(_tensor([1.0, 2.0]), _tensor([1.0, 2.0], "float64")) is False  # another type
    named = wire.TensorsPayload([wire.NamedTensor("OUT", "FP32", (2,), np.asarray([1, 2], "float32").tobytes())])
    renamed = wire.TensorsPayload([wire.NamedTensor("X", "FP32", (2,), np.asarray([1, 2], "float32").tobytes())])
    assert same_answer(named, named) is True
    assert same_answer(named, renamed) is False
    assert same_answer(named, _tensor([1.0, 2.0])) is False


def test_generations_are_not_compared() -> None:
    text = wire.GenerationResult("hi", "stop", 1, 0, 1)
    assert same_answer(text, text) is None


async def test_copies_in_flight_are_capped_and_the_rest_counted_refused() -> None:
    """Copies skip the gateway's admission: a shadow version slower than the traffic must not pile
    them up; beyond `MAX_COPIES_IN_FLIGHT` of a model a copy is not sent."""
    import asyncio

    from prometheus_client import REGISTRY

    from sluice.clock import VirtualClock
    from sluice.gateway.mirror import MAX_COPIES_IN_FLIGHT, Mirror
    from sluice.gateway.tenancy import Tenancy
    from sluice.metrics import GatewayMetrics

    release = asyncio.Event()
    sent: list[str] = []

    async def run(info, payload, ticket):
        sent.append(info.version)
        await release.wait()
        raise asyncio.CancelledError

    info = wire.ModelInfo("capped", "1", "emulated", "p", (), (), 32, 0.27, False, True)
    shadow_info = wire.ModelInfo("capped", "2", "emulated", "p", (), (), 32, 0.27, False, True)
    metrics = GatewayMetrics()
    mirror = Mirror(VirtualClock(), metrics, Tenancy(VirtualClock(), metrics), Shadows(), random.Random(0),
                    lambda name: {"1": info, "2": shadow_info}, run)
    mirror.shadows.start("capped", Shadow("2"))

    def refused() -> float:
        return REGISTRY.get_sample_value("sluice_shadow_requests_total",
                                         {"model": "capped", "version": "2", "outcome": "refused"}) or 0.0

    before = refused()
    copies = [mirror.copy(info, _tensor([1.0]), "acme", 0.0, 10.0) for _ in range(MAX_COPIES_IN_FLIGHT + 3)]
    await asyncio.sleep(0)
    assert sum(c is not None for c in copies) == MAX_COPIES_IN_FLIGHT and refused() - before == 3
    assert len(sent) == MAX_COPIES_IN_FLIGHT
    release.set()  # the copies in flight end: room again
    for _ in range(3):
        await asyncio.sleep(0)
    assert mirror.copy(info, _tensor([1.0]), "acme", 0.0, 10.0) is not None
    await mirror.aclose()
