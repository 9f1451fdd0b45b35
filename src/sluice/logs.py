"""JSON logs on stderr. Prompt and input text are never logged: log ids and sizes, not payloads.

Every line has `time`, `level`, `logger`, `process` and `message`. The access log (one line per
finished request, `api.access_log`) has the same shape, logger `sluice.access`, and is written
here by `write_access` straight to stderr: ~3.5 µs a line (~8 µs with the gathering of its fields),
where a record through `logging` and its JSON formatter costs ~20 µs before its fields are gathered.
On an event loop, the lines of one turn of the loop are written together, in one write (under
overload the gateway answers thousands of requests a second, and a write each cost its tail).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import sys
import time
from typing import Any

import msgspec
from pythonjsonlogger.json import JsonFormatter

ACCESS_LOGGER = "sluice.access"

_process = "gateway"
_encode = msgspec.json.Encoder().encode
_second = -1
_second_text = ""
_pending: list[str] = []
"""Access-log lines of this turn of the event loop, written at its end (`_flush_access`)."""


def configure(level: str = "info", *, process: str = "gateway") -> None:
    global _process
    _process = process
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        static_fields={"process": process},
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("uvicorn.access").disabled = True


def _time_text(now: float) -> str:
    """`now` as the other lines' `time` (`logging`'s asctime: `2026-11-27 11:51:09,123`), local time."""
    global _second, _second_text
    second = int(now)
    if second != _second:
        _second, _second_text = second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second))
    return f"{_second_text},{int((now - second) * 1000):03d}"


def write_access(fields: dict[str, Any]) -> None:
    """One access-log line: `fields` after the usual `time`, `level`, `logger`, `process` and
    `message` ("request"). Written whatever the log level (`--no-access-log` turns it off)."""
    head = {"time": _time_text(time.time()), "level": "INFO", "logger": ACCESS_LOGGER, "process": _process,
            "message": "request"}
    line = _encode({**head, **fields}).decode()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no event loop on this thread: written now, never into the loop's turn
        _write(line + "\n")
        return
    if not _pending:
        loop.call_soon(_flush_access)
    _pending.append(line)


@atexit.register
def _flush_access() -> None:
    if _pending:
        lines = "\n".join(_pending) + "\n"
        _pending.clear()
        _write(lines)


def _write(text: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # stderr closed or gone: the request was still served
        sys.stderr.write(text)
