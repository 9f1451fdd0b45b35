"""Ending background work: tasks, each cancelled by its owner in its `aclose()` (STYLE.md rule 9), and
child processes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel `tasks`, all of them before waiting for any (so they stop together), then wait until
    each has ended. Their `CancelledError` is not raised here; any other exception of theirs is."""
    tasks = list(tasks)
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


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
