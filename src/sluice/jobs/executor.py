"""The batch-job executor: claims items in leases, runs each through the serving app, records outcomes.

    store ─claim(n)─▶ leased items ─▶ app(POST url, x-sluice-priority: batch) ─▶ outcome buffer
      ▲                                                                              │
      └──────────────── record(token, outcomes) every flush_interval_s ◀─────────────┘

- Items go through the app in-process (`asgi_call.call`), so they get the online path's
  validation, batching, deadlines and metrics, at the `batch` priority class, marked as background
  work: on a device that batches requests they yield to online work of any class, riding in its
  batches' spare room while it is active (`sluice.scheduler.backlog`).
- A tenant limit's 429 (one with `retry-after-ms` / `Retry-After`) is a wait, not a failure: the
  item returns to the queue for that long with its attempts untouched, and `TenantPacer` slows the
  tenant's launches down (see `pacing.py`). So is an overload's 503 (`x-sluice-limit: capacity`),
  paced as a concurrency limit. An exhausted credit budget (`x-should-retry: false`)
  is the same wait, until the budget's period resets; if the batch's window ends first, its
  waiting items are written off as `batch_expired`.
- 500/502/503/504 (and a 429 without a Retry-After) are transient: the item returns to the queue
  after an exponential backoff with full jitter (at least the answer's Retry-After), until
  `max_attempts`; then its last answer goes to the error file (dead letter). Other non-2xx
  answers are final at once.
- A 503 while the server is not ready (`GET /v2/health/ready`: its models still loading after a
  restart, a dead worker being replaced, a drain) or while the item's model is not up (`GET
  /v1/models/{model}` answers 503: loading, its worker being restarted) is a wait, not an
  attempt: the item comes back after the answer's Retry-After with its attempts untouched, so a
  job resumed by a restart, or submitted while its model loads, is not written off as dead
  letters while the models load (`app_models`). A model that never comes up holds its
  items until the batch expires (`batch_expired`), so the wait is made visible: the gauge
  `sluice_batch_items_waiting_for_model{model}`, and a warning per batch and model once they
  have waited `model_wait_s`, repeated every `model_wait_s` while they still wait.
- Bounded concurrency: at most `max_in_flight` items are leased and unrecorded at a time; deep
  enough that the worker's queue never runs dry (the device is what the job waits for), started
  `launch_slice` at a time so online requests interleave with a claim's burst.
- The store out of reach (its database restarting) pauses the job, and nothing is lost: outcomes
  not recorded are kept, every lease's, and written once it answers again (a write repeated
  applies once); a lease renewal that failed is tried again at the next round, and due renewals
  are made before each claim, so a lease that lapsed meanwhile is ours again before a claim could
  take its items, still running here, and run them a second time.
- Housekeeping (every `poll_interval_s`, and at once when a batch is created or cancelled or the
  executor runs dry): renew leases still in use, and move each active batch on (`BatchLifecycle`:
  validate and store new batches, finalize finished ones, finish cancelled and expired ones);
  every `expired_files_every_s`, delete the files past their `expires_at` (`expires_after`,
  `output_expires_after`), content and row, so they then answer 404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from sluice.api.common import BACKGROUND_SCOPE_KEY, TENANT_SCOPE_KEY
from sluice.api.errors import CAPACITY_LIMIT
from sluice.jobs import lines
from sluice.jobs.app_models import AppModels
from sluice.jobs.asgi_call import AppResponse, AsgiApp, call
from sluice.jobs.lifecycle import BatchLifecycle
from sluice.jobs.outage import OutageLog
from sluice.jobs.pacing import Refusal, TenantPacer
from sluice.jobs.store import BatchJob, BatchStatus, Claim, Item, ItemOutcome, JobStore
from sluice.jobs.validate import item_model
from sluice.metrics import JobMetrics
from sluice.tasks import cancel_and_wait

log = logging.getLogger("sluice.jobs")

TRANSIENT_STATUSES = frozenset({429, 500, 502, 503, 504})
MIN_REFUSAL_WAIT_S = 0.05
"""A limit's refusal waits at least this long, whatever its Retry-After says (no hot loop)."""
RECORD_RETRY_S = 1.0
"""How soon outcomes that could not be recorded are tried again."""


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    max_in_flight: int = 1024
    claim_size: int = 256
    lease_s: float = 60.0
    max_attempts: int = 5
    backoff_base_s: float = 0.5
    backoff_max_s: float = 60.0
    item_timeout_ms: int = 60_000
    flush_interval_s: float = 0.02
    poll_interval_s: float = 0.25
    launch_slice: int = 32
    """Items of a claim started per event-loop turn: a claim's items all starting at once would keep
    online requests arriving meanwhile waiting for the whole burst to pass through the app."""
    first_load_size: int = 1000
    """Items stored with the batch's start; they run while the rest are stored..."""
    load_chunk_size: int = 5000
    """...in transactions of this many items."""
    model_wait_s: float = 300.0
    """Items waiting for their model to come up are warned of once they have waited this long, and
    again every as long while they still wait."""
    pacing_forget_s: float = 60.0
    """A tenant whose items were refused by its limits is paced until none has been for this long."""
    expired_files_every_s: float = 60.0
    """How often files past their `expires_at` are deleted: they answer 404 at most this long after it."""

    def __post_init__(self) -> None:
        if min(self.max_in_flight, self.claim_size, self.max_attempts, self.launch_slice) < 1 or self.lease_s <= 0:
            raise ValueError("max_in_flight, claim_size, max_attempts and launch_slice must be >= 1, lease_s > 0")


def backoff_s(attempt: int, base_s: float, max_s: float, rng: Callable[[], float] = random.random) -> float:
    """Full jitter: uniform in [0, min(max, base * 2^(attempt-1))] (attempt counts from 1)."""
    return rng() * min(max_s, base_s * 2 ** max(attempt - 1, 0))


class _Lease:
    __slots__ = ("num_open", "until")

    def __init__(self, claim: Claim) -> None:
        self.until = claim.until
        self.num_open = len(claim.items)


class JobExecutor:
    def __init__(self, store: JobStore, config: ExecutorConfig | None = None,
                 metrics: JobMetrics | None = None, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._app: AsgiApp | None = None
        self._config = config or ExecutorConfig()
        self._metrics = metrics or JobMetrics()
        self._clock = clock
        self._wake = asyncio.Event()
        self._is_housekeeping_due = False
        self._models = AppModels(self._config.poll_interval_s)
        self._outage = OutageLog(log, "batch jobs")
        """The store out of reach (its database down) is logged when it begins and ends, not each round."""
        self._lifecycle = BatchLifecycle(store, self._metrics, self._wake.set, self.abandon, clock,
                                         self._config.first_load_size, self._config.load_chunk_size, self._models)
        self._flush_now = asyncio.Event()
        self._leases: dict[str, _Lease] = {}
        self._owners: dict[str, str] = {}
        self._outcomes: dict[str, list[ItemOutcome]] = {}
        self._num_in_flight = 0
        self._pacer = TenantPacer(self._config.pacing_forget_s)
        self._tasks: dict[asyncio.Task[None], tuple[str, str, str]] = {}
        """Each running item's task -> (lease token, batch id, owner)."""
        self._loops: list[asyncio.Task[None]] = []
        self._waiting: dict[tuple[str, int], str] = {}
        """(batch id, idx) -> model of the items whose last answer here was a 503 while it or the server was not up."""
        self._waiting_since: dict[tuple[str, str], tuple[float, float]] = {}
        """(batch id, model) with items waiting -> (when that was first seen, when it was last warned of)."""
        self._waited_models: set[str] = set()
        """Models the waiting gauge was last set for."""
        self._files_checked_at = float("-inf")
        """When (the injected clock) files past their `expires_at` were last deleted."""
        self._headers = [(b"content-type", b"application/json"), (b"x-sluice-priority", b"batch"),
                         (b"x-request-timeout-ms", str(self._config.item_timeout_ms).encode())]

    async def start(self, app: AsgiApp) -> None:
        """Resume every unfinished job and start running items through `app`."""
        self._app = app
        self._models.start(app)
        released = await self._store.release_leases()
        if released:
            log.info("resuming batch jobs: %d items returned to the queue", released)
        self._loops = [asyncio.create_task(self._run()), asyncio.create_task(self._flush_loop())]

    def notify(self) -> None:
        """Something changed (a batch was created or cancelled): look now rather than at the next poll."""
        self._is_housekeeping_due = True
        self._wake.set()

    async def aclose(self) -> None:
        await self._lifecycle.aclose()
        await cancel_and_wait([*self._loops, *self._tasks])
        with contextlib.suppress(Exception):
            await self._flush()  # record what finished; the rest is re-run after its lease expires

    # -- the main loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        next_housekeeping = 0.0
        while True:
            self._wake.clear()  # anything that sets it from here on is seen by the wait below
            try:
                if self._is_housekeeping_due or time.monotonic() >= next_housekeeping:
                    self._is_housekeeping_due = False
                    next_housekeeping = time.monotonic() + self._config.poll_interval_s
                    await self._housekeep()
                while await self._fill():
                    pass
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._outage.failed(exc, "batch executor step failed; retrying")
            else:
                self._outage.succeeded()
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancellation that races
            # with the event being set, and aclose() would then wait for this loop forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._config.poll_interval_s):
                    await self._wake.wait()

    async def _fill(self) -> bool:
        """Claim more items if there is room; True when a full claim came back (there may be more)."""
        room = self._config.max_in_flight - self._num_in_flight
        if room < min(self._config.claim_size, self._config.max_in_flight) // 2 or room <= 0:
            return False
        await self._renew_leases(self._clock())  # ours first: a claim takes items whose lease lapsed
        want = min(room, self._config.claim_size)
        now = self._clock()
        claim = await self._store.claim(want, self._config.lease_s, now, self._pacer.room(now))
        if claim is None:
            return False
        self._leases[claim.token] = _Lease(claim)
        self._num_in_flight += len(claim.items)
        try:
            owners = {batch_id: await self._owner(batch_id) for batch_id in {i.batch_id for i in claim.items}}
        except Exception:
            await self._hand_back(claim, now)
            raise
        for start in range(0, len(claim.items), self._config.launch_slice):
            if start:
                await asyncio.sleep(0)  # online requests get the event loop between slices
            for item in claim.items[start:start + self._config.launch_slice]:
                owner = owners[item.batch_id]
                self._pacer.started(owner)
                task = asyncio.create_task(self._execute(claim.token, item, owner))
                self._tasks[task] = (claim.token, item.batch_id, owner)
                task.add_done_callback(self._forget)
        return len(claim.items) == want

    async def _hand_back(self, claim: Claim, now: float) -> None:
        """Give back the items of a claim that cannot start (their batch's owner could not be read):
        queued again at once, attempts untouched. Their lease is no longer ours to renew, so if
        even that cannot be written they are claimed again once it lapses: never held for ever."""
        self._close_lease(claim.token, len(claim.items))
        with contextlib.suppress(Exception):  # the store is out of reach: the lease lapses instead
            await self._store.record(claim.token, [ItemOutcome(item.batch_id, item.idx, retry_at=now,
                                                               attempts=item.attempts) for item in claim.items])

    def _forget(self, task: asyncio.Task[None]) -> None:
        _, _, owner = self._tasks.pop(task, ("", "", ""))
        if task.cancelled():
            self._pacer.abandoned(owner)

    async def abandon(self, batch_id: str) -> None:
        """Stop the batch's running items (it is cancelled or expired) and record those that finished,
        so that finalizing writes off exactly the items that have no outcome."""
        stopped = [(task, token) for task, (token, owner_batch, _) in self._tasks.items() if owner_batch == batch_id]
        await cancel_and_wait(task for task, _ in stopped)
        for task, token in stopped:
            if task.cancelled():
                self._close_lease(token, 1)
        await self._flush()

    async def _owner(self, batch_id: str) -> str:
        owner = self._owners.get(batch_id)
        if owner is None:
            batch = await self._store.get_batch(None, batch_id)
            owner = self._owners[batch_id] = batch.owner if batch else ""
        return owner

    async def _execute(self, token: str, item: Item, owner: str) -> None:
        assert self._app is not None
        try:
            answer = await call(self._app, "POST", item.url, item.body, self._headers,
                                {TENANT_SCOPE_KEY: owner, BACKGROUND_SCOPE_KEY: True})
            is_unready = answer.status_code == 503 and answer.limit != CAPACITY_LIMIT and \
                await self._models.is_waiting(owner, item_model(item.url, item.body))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # the app answers errors itself: this is a bug. Record it and keep going (an item left
            # without an outcome would be held, its lease renewed, for ever)
            log.exception("batch item %s/%d raised", item.batch_id, item.idx)
            self._pacer.answered(owner)
            line = lines.error_only_line(item.custom_id, "internal_error", f"{type(exc).__name__}")
            self._finish(token, ItemOutcome(item.batch_id, item.idx, line, True, attempts=item.attempts + 1))
            return
        self._finish(token, self._outcome(item, owner, answer, is_unready))

    def _outcome(self, item: Item, owner: str, answer: AppResponse, is_unready: bool = False) -> ItemOutcome:
        now = self._clock()
        if is_unready:
            self._waiting[(item.batch_id, item.idx)] = item_model(item.url, item.body)
        else:
            self._waiting.pop((item.batch_id, item.idx), None)
        usage = lines.read_usage(answer.body)
        refusal = _limit_refusal(answer)
        if refusal is not None:  # wait for the limit, attempts untouched
            self._pacer.refused(owner, refusal, now)
            return ItemOutcome(item.batch_id, item.idx, retry_at=now + refusal.retry_after_s, attempts=item.attempts)
        self._pacer.answered(owner)
        if is_unready:  # the models are loading (a restart): wait for them, attempts untouched
            wait_s = max(answer.retry_after_s or 1.0, MIN_REFUSAL_WAIT_S)
            return ItemOutcome(item.batch_id, item.idx, retry_at=now + wait_s, attempts=item.attempts)
        status = answer.status_code
        attempts = item.attempts + 1
        is_transient = status in TRANSIENT_STATUSES and answer.should_retry  # e.g. a request too large: final
        if is_transient and attempts < self._config.max_attempts:
            self._metrics.item_retried()
            delay = max(backoff_s(attempts, self._config.backoff_base_s, self._config.backoff_max_s),
                        answer.retry_after_s or 0.0)
            return ItemOutcome(item.batch_id, item.idx, retry_at=now + delay, attempts=attempts)
        is_error = not 200 <= status < 300
        self._metrics.item_done("dead_letter" if is_error and is_transient else "error" if is_error else "ok")
        line = lines.response_line(item.custom_id, status, answer.request_id, answer.body)
        return ItemOutcome(item.batch_id, item.idx, line, is_error, usage.input_tokens, usage.output_tokens,
                           usage.cached_tokens, usage.reasoning_tokens, attempts=attempts)

    def _finish(self, token: str, outcome: ItemOutcome) -> None:
        self._outcomes.setdefault(token, []).append(outcome)
        self._flush_now.set()

    # -- recording -------------------------------------------------------------------------------

    async def _flush_loop(self) -> None:
        while True:
            await self._flush_now.wait()
            await asyncio.sleep(self._config.flush_interval_s)  # gather a transaction's worth
            self._flush_now.clear()
            try:
                await self._flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._outage.failed(exc, "recording batch item outcomes failed; retrying")
                self._flush_now.set()
                await asyncio.sleep(RECORD_RETRY_S)

    async def _flush(self) -> None:
        """Record the outcomes gathered so far, a transaction per lease. Those not recorded when a
        transaction fails (the store is unreachable) stay for the next flush, every lease's: an
        outcome dropped would leave its item held here, its lease renewed, for ever."""
        pending, self._outcomes = self._outcomes, {}
        try:
            for token in list(pending):
                await self._store.record(token, pending[token])  # an outcome recorded twice applies once
                self._close_lease(token, len(pending.pop(token)))
        finally:
            for token, outcomes in pending.items():
                self._outcomes[token] = outcomes + self._outcomes.get(token, [])
        if not self._num_in_flight:
            self._is_housekeeping_due = True  # a batch may be drained: finalize it now, not at the next poll
        self._wake.set()

    def _close_lease(self, token: str, num_items: int) -> None:
        """`num_items` of the lease `token` are no longer ours to run."""
        lease = self._leases.get(token)
        if lease is not None:
            lease.num_open -= num_items
            if lease.num_open <= 0:
                del self._leases[token]
        self._num_in_flight -= num_items

    # -- housekeeping ----------------------------------------------------------------------------

    async def _housekeep(self) -> None:
        now = self._clock()
        await self._renew_leases(now)
        if now - self._files_checked_at >= self._config.expired_files_every_s:
            self._files_checked_at = now
            num_deleted = await self._store.delete_expired_files(int(now))
            if num_deleted:
                log.info("deleted %d files past their expires_at", num_deleted)
        num_queued = 0
        active = await self._store.active_batches()
        self._owners = {batch.id: batch.owner for batch in active}
        for batch in active:
            if batch.status is not BatchStatus.VALIDATING:
                num_queued += batch.num_total - batch.num_completed - batch.num_failed
            await self._lifecycle.step(batch, now)
        self._metrics.pending(max(num_queued - self._num_in_flight, 0), self._num_in_flight)
        self._report_waiting({batch.id: batch for batch in active if batch.status is BatchStatus.IN_PROGRESS}, now)

    def _report_waiting(self, running: dict[str, BatchJob], now: float) -> None:
        """The items waiting for a model that is not up: counted per model, and warned of per batch and
        model once they have waited `model_wait_s` (again every `model_wait_s`)."""
        self._waiting = {key: model for key, model in self._waiting.items() if key[0] in running}
        groups = Counter((batch_id, model) for (batch_id, _), model in self._waiting.items())
        self._waiting_since = {key: self._waiting_since.get(key, (now, now)) for key in groups}
        for (batch_id, model), count in groups.items():
            since, warned_at = self._waiting_since[(batch_id, model)]
            if now - since >= self._config.model_wait_s and now - warned_at >= self._config.model_wait_s:
                self._waiting_since[(batch_id, model)] = (since, now)
                log.warning("batch %s: %d items have waited %.0f s for the model %r, which is not up (loading, or "
                            "its worker being restarted); they wait until the batch expires in %.0f s, unless it "
                            "is cancelled", batch_id, count, now - since, model,
                            max(running[batch_id].expires_at - now, 0.0))
        counts = Counter(model for model in self._waiting.values())
        self._metrics.waiting_for_models({**dict.fromkeys(self._waited_models, 0), **counts})
        self._waited_models = set(counts)

    async def _renew_leases(self, now: float) -> None:
        """Items may wait long behind online traffic: keep their leases alive while we hold them."""
        for token, lease in list(self._leases.items()):
            if lease.until - now < self._config.lease_s / 2:
                until = now + self._config.lease_s
                await self._store.extend_lease(token, until)
                lease.until = until  # only once stored: a failed renewal is tried again at the next round


def _limit_refusal(answer: AppResponse) -> Refusal | None:
    """A tenant limit's 429 says when to come back; one without a Retry-After is an ordinary transient
    failure. So does an overload's 503 (`x-sluice-limit: capacity`: the work queued ahead of the
    item would make it miss its deadline), paced as a concurrency limit: the job's own depth of
    items in flight, or online traffic, is more than the model gets through in an item's time."""
    is_overload = answer.status_code == 503 and answer.limit == CAPACITY_LIMIT
    if not (answer.status_code == 429 or is_overload) or answer.retry_after_s is None:
        return None
    return Refusal(max(answer.retry_after_s, MIN_REFUSAL_WAIT_S), is_overload or answer.limit == "concurrency")
