"""`sluice.tasks`: a loop waiting on an event with a timeout stops when cancelled, even when the
cancellation and the event come together (Python 3.11's `asyncio.wait_for` swallows that
cancellation, and an `aclose()` waiting for the loop then never returns)."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from sluice.tasks import cancel_and_wait, sleep, wait_event


@pytest.mark.parametrize("turns_between", range(5))
async def test_a_cancel_arriving_with_the_event_stops_the_waiting_loop(turns_between: int):
    event = asyncio.Event()
    rounds = 0

    async def housekeep() -> None:
        nonlocal rounds
        while True:
            await wait_event(event, 5.0)
            event.clear()
            rounds += 1

    task = asyncio.create_task(housekeep())
    await asyncio.sleep(0.01)
    event.set()
    for _ in range(turns_between):
        await asyncio.sleep(0)
    async with asyncio.timeout(2):
        await cancel_and_wait([task])
    assert task.cancelled()


async def test_a_loop_whose_call_lost_the_cancel_ends_at_its_next_pause():
    """As redis-py's write under Python 3.11's `wait_for`: the call returns its result although the
    task was cancelled in it. The loop ends at its next `tasks.sleep` instead of going on for ever."""
    calls = 0

    async def call_that_drops_a_cancel() -> str:
        nonlocal calls
        calls += 1
        with contextlib.suppress(asyncio.CancelledError):  # finished anyway: the cancel is dropped
            await asyncio.sleep(10)
        return "OK"

    async def renew() -> None:
        while True:
            await call_that_drops_a_cancel()
            await sleep(0.001)

    task = asyncio.create_task(renew())
    await asyncio.sleep(0.01)
    async with asyncio.timeout(2):
        await cancel_and_wait([task])
    assert task.cancelled() and calls == 1


async def test_it_says_whether_the_event_came_or_the_time_ran_out():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await wait_event(event, 5.0) is True


async def test_a_timeout_around_the_wait_for_a_slow_task_is_kept():
    async def slow_to_stop() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await asyncio.sleep(0.5)  # cleans up for a while after being cancelled
            raise

    task = asyncio.create_task(slow_to_stop())
    await asyncio.sleep(0.01)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await cancel_and_wait([task])
    await asyncio.wait([task])
    assert task.cancelled()


async def test_a_task_that_failed_raises_its_error():
    async def fails() -> None:
        raise ValueError("broken")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="broken"):
        await cancel_and_wait([task])
