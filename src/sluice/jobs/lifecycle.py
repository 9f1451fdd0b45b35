"""A batch's way through its statuses, driven by the executor's housekeeping.

    validating ─parse─▶ in_progress ─every item done─▶ finalizing ─files written─▶ completed
        │   │               │  (items stored in chunks while the first ones run)
        │   │               ├─ cancel ──────────▶ cancelling ─▶ cancelled
        ▼   │               └─ now ≥ expires_at ─────────────▶ expired
      failed└─ now ≥ expires_at, not yet started ────────────▶ expired (no items, no files)

Each arrow is one committed store call, so a server killed anywhere resumes from the status it
left: a batch whose items were half stored stores the rest (checked once per batch), a
finalizing batch writes its files again. Cancelled and expired batches keep every item that finished; the others, those
still running included (they are stopped), go to the error file with the code `batch_cancelled` /
`batch_expired`.

Validation and storing run as one background task per batch, so a large new file never stalls
the items of the batches already running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

from sluice.jobs import lines
from sluice.jobs.outage import OutageLog
from sluice.jobs.store import BatchJob, BatchStatus, JobStore, NewItem
from sluice.jobs.validate import Invalid, ModelDirectory, Valid, parse_input
from sluice.metrics import JobMetrics
from sluice.tasks import cancel_and_wait

log = logging.getLogger("sluice.jobs")

_STORE_RETRY_S = 1.0


class BatchLifecycle:
    def __init__(self, store: JobStore, metrics: JobMetrics, wake: Callable[[], None],
                 abandon: Callable[[str], Awaitable[None]], clock: Callable[[], float] = time.time,
                 first_load_size: int = 1000, load_chunk_size: int = 5000,
                 models: ModelDirectory | None = None) -> None:
        """`wake` asks the executor to claim now; `abandon(batch_id)` stops the batch's running items
        and records those that finished. `models`: what the batch's tenant may use, checked at
        validation (None: not checked)."""
        if first_load_size < 1 or load_chunk_size < 1:
            raise ValueError("first_load_size and load_chunk_size must be >= 1")
        self._models = models
        self._store = store
        self._metrics = metrics
        self._wake = wake
        self._abandon = abandon
        self._clock = clock
        self._first_load_size = first_load_size
        self._load_chunk_size = load_chunk_size
        self._loading: dict[str, asyncio.Task[None]] = {}
        self._fully_stored: set[str] = set()
        """Started batches seen with all their items stored (checked once per batch and process)."""
        self._outage = OutageLog(log, "batch jobs: validating and storing items")
        """The store out of reach (its database down) is logged when it begins and ends, not each try."""

    async def step(self, batch: BatchJob, now: float) -> None:
        """Move `batch` on if it can move now; a batch being validated or stored waits for that."""
        if batch.id in self._loading:
            return
        if batch.status is BatchStatus.VALIDATING and now >= batch.expires_at:
            # its window ended before it could start (its file unreadable, the store down): as
            # OpenAI's, it expires, with no items and no files
            await self._write_off(batch, BatchStatus.EXPIRED, "batch_expired", now)
        elif batch.status is BatchStatus.VALIDATING:
            self._own(batch.id, self._validate(batch))
        elif batch.id not in self._fully_stored and not await self._check_stored(batch):
            return
        elif batch.status is BatchStatus.FINALIZING or (
                batch.status is BatchStatus.IN_PROGRESS and batch.num_completed + batch.num_failed >= batch.num_total):
            await self._complete(batch, now)
        elif batch.status is BatchStatus.CANCELLING:
            await self._write_off(batch, BatchStatus.CANCELLED, "batch_cancelled", now)
        elif batch.status is BatchStatus.IN_PROGRESS and now >= batch.expires_at:
            await self._write_off(batch, BatchStatus.EXPIRED, "batch_expired", now)

    async def aclose(self) -> None:
        await cancel_and_wait(self._loading.values())

    # -- validating and storing ------------------------------------------------------------------

    def _own(self, batch_id: str, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._loading[batch_id] = task
        task.add_done_callback(lambda _: self._loading.pop(batch_id, None))

    async def _validate(self, batch: BatchJob) -> None:
        try:
            rest = await self._start(batch)
        except Exception as exc:  # the next housekeeping round validates it again
            self._outage.failed(exc, f"batch {batch.id}: validation failed; retrying")
            return
        self._outage.succeeded()
        if rest is not None:
            self._wake()  # the first items run while the rest are stored
            await self._store_items(batch.id, rest)

    async def _start(self, batch: BatchJob) -> Sequence[NewItem] | None:
        """Validate the batch's file: fail the batch, or start it with its first items; the items
        left to store once it started, None if it did not."""
        now = int(self._clock())
        content = await self._store.file_content(batch.owner, batch.input_file_id)
        if content is None:
            await self._fail(batch, [{"code": "input_file_missing", "param": "input_file_id", "line": None,
                                      "message": "the input file was deleted"}], now)
            return None
        parsed = await self._parse(batch, content)
        if not isinstance(parsed, Valid):
            await self._fail(batch, parsed.errors, now)
            return None
        first, rest = parsed.items[:self._first_load_size], parsed.items[self._first_load_size:]
        return rest if await self._store.start_batch(batch.id, first, now, num_total=len(parsed.items)) else None

    async def _parse(self, batch: BatchJob, content: bytes) -> Valid | Invalid:
        """The file's items, or its problems. The models it names must be listed for the tenant, or
        known though not up yet (loading, their worker being restarted: its items wait for them
        once it runs, until the batch expires); another is `model_not_found`, at once. Names not
        listed are asked of the server one by one, only those the file's errors name: a file
        naming more such models than it may have errors is parsed again with those found."""
        if self._models is None:
            return await asyncio.to_thread(parse_input, content, batch.endpoint)
        usable = set(await self._models.listed(batch.owner))
        while True:
            parsed = await asyncio.to_thread(parse_input, content, batch.endpoint, frozenset(usable))
            if isinstance(parsed, Valid):
                return parsed
            known = {model for model in parsed.unknown_models if await self._models.is_known(batch.owner, model)}
            if not known:
                return parsed
            usable |= known

    async def _fail(self, batch: BatchJob, errors: list[dict[str, object]], now: int) -> None:
        await self._store.fail_batch(batch.id, errors, now)
        self._metrics.job_done(BatchStatus.FAILED.value, now - batch.created_at)

    async def _check_stored(self, batch: BatchJob) -> bool:
        """True when every item of `batch` is stored; if not (a crash, here or on another gateway,
        interrupted storing them), store the rest. Inserts ignore items already there, so two
        gateways doing this at once only repeat work."""
        num_stored = await self._store.num_items(batch.id)
        if num_stored >= batch.num_total:
            self._fully_stored.add(batch.id)
            return True
        log.info("batch %s: storing its items from %d of %d", batch.id, num_stored, batch.num_total)
        self._own(batch.id, self._reload(batch, num_stored))
        return False

    async def _reload(self, batch: BatchJob, num_stored: int) -> None:
        try:
            content = await self._store.file_content(batch.owner, batch.input_file_id)
        except Exception as exc:  # the next housekeeping round checks the batch again
            self._outage.failed(exc, f"batch {batch.id}: reading its input file failed; retrying")
            return
        parsed = None if content is None else await asyncio.to_thread(parse_input, content, batch.endpoint)
        if not isinstance(parsed, Valid):
            log.error("batch %s: its input file is gone or changed; only %d of %d items were stored and "
                      "the batch can only expire or be cancelled", batch.id, num_stored, batch.num_total)
            self._fully_stored.add(batch.id)  # nothing more to store: do not try again
            return
        await self._store_items(batch.id, parsed.items[num_stored:])

    async def _store_items(self, batch_id: str, items: Sequence[NewItem]) -> None:
        for start in range(0, len(items), self._load_chunk_size):
            chunk = items[start:start + self._load_chunk_size]
            while True:
                try:
                    await self._store.add_items(batch_id, chunk)
                except Exception as exc:
                    self._outage.failed(exc, f"batch {batch_id}: storing items failed; retrying")
                    await asyncio.sleep(_STORE_RETRY_S)
                else:
                    self._outage.succeeded()
                    break
            self._wake()

    # -- finishing -------------------------------------------------------------------------------

    async def _complete(self, batch: BatchJob, now: float) -> None:
        """in_progress -> finalizing (committed, so clients see it) -> completed with its files."""
        is_finalizing = batch.status is BatchStatus.FINALIZING
        if not is_finalizing and await self._store.begin_finalizing(batch.id, int(now)) is None:
            return
        done = await self._store.finalize(batch.id, BatchStatus.COMPLETED, None, int(now))
        if done is not None and done.status is BatchStatus.COMPLETED:
            self._finished(done, now)

    async def _write_off(self, batch: BatchJob, final: BatchStatus, code: str, now: float) -> None:
        """Items with an outcome are kept; the rest, running ones included, are written off at once:
        items queued behind online traffic could otherwise hold a cancelled or expired batch open
        for as long as their own deadline."""
        await self._abandon(batch.id)
        message = f"the batch was {final.value} before this request ran"
        done = await self._store.finalize(batch.id, final, lambda custom_id: lines.error_only_line(
            custom_id, code, message), int(now))
        if done is not None and done.status is final:
            self._metrics.item_done(final.value, done.num_total - done.num_completed - done.num_failed)
            self._finished(done, now)

    def _finished(self, done: BatchJob, now: float) -> None:
        self._fully_stored.discard(done.id)
        self._metrics.job_done(done.status.value, now - done.created_at)
        log.info("batch %s %s: %d ok, %d failed of %d", done.id, done.status.value, done.num_completed,
                 done.num_failed, done.num_total)
