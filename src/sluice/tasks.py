"""Ending background work: tasks, each cancelled by its owner in its `aclose()` (STYLE.md rule 9), and
child processes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel `tasks`, all of them before waiting for any (so they stop together), then wait until
    each has ended. Their `CancelledError` is not raised here; any other exception of theirs is, and so is
    a cancellation of the caller while it waits (a timeout around an `aclose()` works)."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    await asyncio.wait(tasks)  # a cancellation of the caller itself comes through
    for task in tasks:
        if not task.cancelled() and (error := task.exception()) is not None:
            raise error


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until `event` is set or `timeout_s` has passed; whether it is set. Unlike Python 3.11's
    `asyncio.wait_for`, a cancellation that arrives as the event is set is not swallowed (a loop
    waiting here would go on after its owner's `aclose()` cancelled it, and that `aclose()` would
    never return)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            await event.wait()
    return event.is_set()


async def sleep(delay_s: float) -> None:
    """`asyncio.sleep`, for a loop whose other awaits may lose a cancellation: redis-py writes through
    Python 3.11's `asyncio.wait_for`, which returns the result and drops a cancel that arrives as the
    write completes. The task still counts that cancel (`cancelling()`), so it is raised here, at the
    loop's next pause, and the loop's owner, waiting in `cancel_and_wait`, is not left waiting forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
    await asyncio.sleep(delay_s)


async def stop_process(process: asyncio.subprocess.Process, grace_s: float) -> None:
    """End a child process that is still running: SIGTERM, then SIGKILL if it has not exited
    within `grace_s`; returns once it has exited."""
    if process.returncode is not None:
        return
    process.terminate()
    try:
        await asyncio.wait_for(process.wait(), grace_s)
    except TimeoutError:
        process.kill()
        await process.wait()
