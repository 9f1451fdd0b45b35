"""Traffic splits and canaries shared through a real Redis (`gateway.shared_traffic`): a change is
published once, by the gateway where it was made, never again by those that follow it."""

from __future__ import annotations

import asyncio

import redis

from sluice.clock import VirtualClock
from sluice.gateway.gateway import Gateway
from sluice.gateway.shared_traffic import RECORDS, REVISIONS, SharedTraffic
from sluice.gateway.traffic import CanaryPlan, Split
from sluice.metrics import GatewayMetrics

PLAN = CanaryPlan(version="2", baseline="1", steps=(10.0, 50.0), step_s=30.0, min_requests=50)


def test_a_change_is_published_once_by_the_gateway_that_made_it(redis_url: str) -> None:
    url = redis_url.rsplit("/", 1)[0] + "/10"  # the shared traffic's keys are fixed: a database of its own
    client = redis.Redis.from_url(url)
    client.flushdb()

    async def scenario() -> None:
        gateways = {name: Gateway(VirtualClock(), GatewayMetrics()) for name in ("one", "two")}
        for name, gateway in gateways.items():  # polling left to the test: sync() by hand
            gateway.shared_traffic = SharedTraffic(url, name, gateway.traffic, gateway.canary_event, poll_s=3600)
            await gateway.shared_traffic.start()
        one, two = gateways["one"], gateways["two"]
        one.traffic.start_canary("m", PLAN, one.now(), Split.of({"1": 100}, False))
        await one.share_traffic("m")
        assert two.shared_traffic is not None and one.shared_traffic is not None
        await two.shared_traffic.sync()
        assert two.traffic.remote_canary("m") is not None  # two follows one's canary
        two.traffic.set_split("m", Split.of({"1": 100}, False))  # an operator on two replaces it
        await two.share_traffic("m")
        await one.shared_traffic.sync()  # one follows: its canary ends there
        assert not one.traffic.has_canary("m")
        await asyncio.sleep(0.2)  # a publish scheduled by the canary's end would have run by now
        assert int(client.hget(REVISIONS, "m") or 0) == 2  # one's canary, two's split: nothing more
        assert b'"by": "two"' in (client.hget(RECORDS, "m") or b"")
        for gateway in gateways.values():
            assert gateway.shared_traffic is not None
            await gateway.shared_traffic.aclose()

    asyncio.run(scenario())
