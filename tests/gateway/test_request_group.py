"""A client request made of several generations (a batch of prompts) is one request to the
tenant's limits: one concurrency slot, one request from the per-minute bucket, its parts' tokens
reserved together and settled with their sum when the last part ends."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sluice import wire
from sluice.clock import VirtualClock
from sluice.errors import RateLimited
from sluice.gateway.tenancy import RequestGroup, Tenancy
from sluice.gateway.ticket import Ticket
from sluice.metrics import GatewayMetrics
from sluice.priority import Priority

INFO = wire.ModelInfo("m", "1", "generative", "p", (), (), 32, 60.0, True, False)


def _tenancy(tmp_path: Path, limits: str) -> tuple[Tenancy, VirtualClock]:
    path = tmp_path / "tenants.toml"
    path.write_text(f"[tenants.a]\n{limits}\n")
    clock = VirtualClock()
    return Tenancy(clock, GatewayMetrics(), path), clock


async def _part(tenancy: Tenancy, clock: VirtualClock, group: RequestGroup, tokens: float,
                hold: asyncio.Event) -> None:
    """One part: admitted through the group, then runs (until `hold` is set) and ends using `tokens`."""
    tenant = tenancy.tenant("a")
    reservation = await group.admit(tenancy, tenant, Priority.STANDARD)
    ticket = Ticket(GatewayMetrics(), tenancy, clock, INFO, "a", Priority.STANDARD, reservation, 0.0, 60.0,
                    group=group)
    async with ticket:
        await hold.wait()
        ticket.charge(tokens, 0.5)


async def test_a_batch_of_parts_holds_one_slot_and_one_request_and_settles_their_sum(tmp_path):
    tenancy, clock = _tenancy(tmp_path, "max_concurrent = 1\nrequests_per_min = 2\ntokens_per_min = 1000")
    group = RequestGroup(estimated_tokens=400.0)
    hold = asyncio.Event()
    parts = [asyncio.create_task(_part(tenancy, clock, group, 30.0, hold)) for _ in range(4)]
    await asyncio.sleep(0)
    (usage,) = await tenancy.usage()
    assert usage.in_flight == 1  # four parts, one concurrency slot
    with pytest.raises(RateLimited):  # ...which another request cannot have meanwhile
        await tenancy.admit(tenancy.tenant("a"), Priority.STANDARD, 10.0)
    hold.set()
    await asyncio.gather(*parts)
    (usage,) = await tenancy.usage()
    assert usage.in_flight == 0 and usage.device_s == pytest.approx(2.0)  # the four parts' device time
    single = await tenancy.admit(tenancy.tenant("a"), Priority.STANDARD, 10.0)  # the second request of 2 a minute
    statuses = {s.name: s for s in single.statuses}
    assert statuses["tokens"].remaining == pytest.approx(1000 - 120 - 10)  # settled: 4 x 30 used, not 400
    with pytest.raises(RateLimited):
        await tenancy.admit(tenancy.tenant("a"), Priority.STANDARD, 10.0)  # a third: the batch counted once


async def test_a_refused_batch_refuses_every_part_and_takes_nothing(tmp_path):
    tenancy, clock = _tenancy(tmp_path, "tokens_per_min = 100")
    group = RequestGroup(estimated_tokens=400.0)
    hold = asyncio.Event()
    hold.set()
    results = await asyncio.gather(*[_part(tenancy, clock, group, 1.0, hold) for _ in range(3)],
                                   return_exceptions=True)
    assert all(isinstance(r, RateLimited) for r in results)
    (usage,) = await tenancy.usage()
    assert usage.in_flight == 0


async def test_a_part_that_starts_after_the_others_ended_is_admitted_anew(tmp_path):
    tenancy, clock = _tenancy(tmp_path, "max_concurrent = 1")
    group = RequestGroup(estimated_tokens=10.0)
    done = asyncio.Event()
    done.set()
    await _part(tenancy, clock, group, 1.0, done)
    await _part(tenancy, clock, group, 1.0, done)
    (usage,) = await tenancy.usage()
    assert usage.in_flight == 0
