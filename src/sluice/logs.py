"""JSON logs on stderr, written by one thread that nothing waits for. Prompt and input text are
never logged: log ids and sizes, not payloads.

Every line has `time`, `level`, `logger`, `process` and `message`. The access log (one line per
finished request, `api.access_log`) has the same shape, logger `sluice.access`, and is built here
by `write_access`, not through `logging`: ~3.5 µs a line (~8 µs with the gathering of its fields),
where a record through `logging` and its JSON formatter costs ~15-20 µs. On an event loop, the
lines of one turn of the loop are handed on together, at its end (under overload the gateway
answers thousands of requests a second, and a write each cost its tail).

    logging records ──format──┐                       (this process's one writer thread)
    access lines of a turn ───┴─> bounded queue ───> _Writer ───> sys.stderr
                                  (1 MiB of text)        └─ full: dropped, counted

A stderr that nobody reads (a stuck log shipper, a paused `kubectl logs`, a full 64 KiB pipe)
blocks only the writer thread, never the event loop nor any thread that logs: once the queue
holds `MAX_QUEUED_CHARS`, new lines are dropped (no exception, no traceback), counted by
`configure`'s `on_dropped` (`sluice_log_lines_dropped_total`), and the writer says how many in
one line once it has caught up. Lines are written in the order they were handed on; at exit
whatever is queued is written first (up to `EXIT_FLUSH_S` for a stderr that does not drain).
"""

from __future__ import annotations

import asyncio
import atexit
import io
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any, cast

import msgspec
from pythonjsonlogger.json import JsonFormatter

ACCESS_LOGGER = "sluice.access"
MAX_QUEUED_CHARS = 1 << 20
"""Text waiting for stderr before new lines are dropped: ~2,500 access lines, about a second of
the gateway's under 2x overload, on top of the pipe's own buffer."""
_NAP_S = 0.001
"""The writer's pause after each write, for lines to gather meanwhile: woken by each turn's lines
instead (thousands of turns a second under load), it cost the event loop's thread ~8 µs a turn."""
EXIT_FLUSH_S = 5.0
"""How long exit waits for the queued lines to be written (a stderr nobody reads never is)."""

_process = "gateway"
_encode = msgspec.json.Encoder().encode
_second = -1
_second_text = ""
_pending: list[str] = []
"""Access-log lines of this turn of the event loop, handed on at its end (`_flush_access`)."""
_pending_thread = 0
"""The thread whose event loop `_pending` belongs to."""


class _TextQueue(queue.Queue[str | threading.Event]):
    """A queue bounded by the length of its text, not by its number of items (an item is a line,
    or the lines of one turn of the event loop; a flush marker counts 1)."""

    def _init(self, maxsize: int) -> None:
        self.queue: deque[str | threading.Event] = deque()
        self.num_chars = 0

    def _qsize(self) -> int:
        return self.num_chars

    def _put(self, item: str | threading.Event) -> None:
        self.queue.append(item)
        self.num_chars += len(item) if isinstance(item, str) else 1

    def _get(self) -> str | threading.Event:
        item = self.queue.popleft()
        self.num_chars -= len(item) if isinstance(item, str) else 1
        return item


class _Writer:
    """The one writer of this process's stderr: a daemon thread, started with the first line,
    writes what `put` queued, in order, several items in one write when it has fallen behind."""

    def __init__(self, max_chars: int) -> None:
        self.on_dropped: Callable[[int], None] | None = None
        self._queue = _TextQueue(max_chars)
        self._max_chars = max_chars
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._num_dropped = 0
        """Lines dropped since the writer last said so."""

    def put(self, text: str) -> None:
        """Queue `text` (whole lines) for stderr, or drop it if the queue is full. Never blocks."""
        if self._thread is None:
            self._start()
        if self._queue.num_chars + len(text) <= self._max_chars:  # (read unlocked: put_nowait checks again)
            try:
                self._queue.put_nowait(text)
                return
            except queue.Full:
                pass
        self._drop(text.count("\n"))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every line queued before this call is written; False if not within `timeout_s`."""
        if self._thread is None:
            return True
        give_up = time.monotonic() + timeout_s
        written = threading.Event()
        try:
            self._queue.put(written, timeout=timeout_s)
        except queue.Full:
            return False
        return written.wait(max(0.0, give_up - time.monotonic()))

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="sluice-log-writer", daemon=True)
                thread.start()
                self._thread = thread

    def _drop(self, num_lines: int) -> None:
        with self._lock:
            self._num_dropped += num_lines
        on_dropped = self.on_dropped
        if on_dropped is not None:
            on_dropped(num_lines)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            texts: list[str] = []
            while True:
                if isinstance(item, str):
                    texts.append(item)
                else:  # a flush marker: what came before it is written
                    self._write(texts)
                    texts = []
                    item.set()
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            self._write(texts)
            self._say_dropped()
            time.sleep(_NAP_S)

    def _say_dropped(self) -> None:
        """Caught up: one line for the lines dropped since the last one."""
        with self._lock:
            num_dropped, self._num_dropped = self._num_dropped, 0
        if num_dropped:
            now = time.time()  # (not `_time_text`, whose cache is the event loop thread's)
            self._write([_encode({
                "time": f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(now))},{int(now % 1 * 1000):03d}",
                "level": "WARNING", "logger": "sluice.logs", "process": _process,
                "message": f"{num_dropped} log lines dropped: stderr was not read fast enough",
                "num_dropped": num_dropped}).decode() + "\n"])

    @staticmethod
    def _write(texts: list[str]) -> None:
        if not texts:
            return
        try:
            sys.stderr.write("".join(texts))
            sys.stderr.flush()
        except Exception:  # stderr closed or gone: the requests were still served
            pass


_writer = _Writer(MAX_QUEUED_CHARS)


class _WriterHandler(logging.Handler):
    """Formats a record on the thread that logged it (what `logging.StreamHandler` did) and queues
    its line for the writer, after the access lines this thread's event loop still holds."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception:  # a record that cannot be formatted: logging's own report, as before
            self.handleError(record)
            return
        if _pending and _pending_thread == threading.get_ident():
            _flush_access()
        _writer.put(text + "\n")


def configure(level: str = "info", *, process: str = "gateway",
              on_dropped: Callable[[int], None] | None = None) -> None:
    """Log records at `level` and up (and Python's warnings) as JSON lines, through this process's
    writer; `on_dropped(n)` is called on the thread whose `n` lines were dropped (a stderr not read
    fast enough)."""
    global _process
    _process = process
    _writer.on_dropped = on_dropped
    handler = _WriterHandler()
    handler.setFormatter(JsonFormatter(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        static_fields={"process": process},
    ))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("uvicorn.access").disabled = True
    logging.captureWarnings(True)  # a warning is a record too (`py.warnings`), not a write to stderr


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
    global _pending_thread
    head = {"time": _time_text(time.time()), "level": "INFO", "logger": ACCESS_LOGGER, "process": _process,
            "message": "request"}
    line = _encode({**head, **fields}).decode()
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # no event loop on this thread: queued now, never into the loop's turn
        _writer.put(line + "\n")
        return
    if not _pending:
        loop.call_soon(_flush_access)
        _pending_thread = threading.get_ident()
    _pending.append(line)


def _flush_access() -> None:
    if _pending:
        lines = "\n".join(_pending) + "\n"
        _pending.clear()
        _writer.put(lines)


def queued_stderr() -> IO[str]:
    """A text file whose writes go through this process's writer, in order with the log lines: for
    what is printed to stderr rather than logged (`sluice serve`'s banner, from its event loop)."""
    return cast(IO[str], _QueuedStderr())


class _QueuedStderr(io.TextIOBase):

    def write(self, text: str) -> int:
        if text:
            _writer.put(text)
        return len(text)

    def isatty(self) -> bool:
        return sys.stderr.isatty()


@atexit.register
def _flush_at_exit() -> None:
    """Write what is queued before the process exits (atexit runs this before `logging.shutdown`),
    with the access lines of the event loop's last turn, whichever thread ran it."""
    _flush_access()
    _writer.flush(EXIT_FLUSH_S)


def _after_fork() -> None:
    """A forked child has no writer thread and may hold a copy of a locked queue: a new writer."""
    global _writer
    on_dropped, _writer = _writer.on_dropped, _Writer(MAX_QUEUED_CHARS)
    _writer.on_dropped = on_dropped
    _pending.clear()


os.register_at_fork(after_in_child=_after_fork)
