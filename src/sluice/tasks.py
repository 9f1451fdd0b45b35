"""Ending background tasks: each has an owner that cancels it in its `aclose()` (STYLE.md rule 9)."""

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
