"""One-shot requests on the worker (embeddings, classifiers, tensors; `Batches`), from their
arrival to their answer:

    submit ──▶ runner.prepare ──▶ scheduler.admit ──▶ queue
                                                        │ device free (kick)
    ◀──Started── ◀── scheduler.next_batch ◀─────────────┘
    ◀──Result──── gather per request ◀── device thread: runner.run_batch (batch_done)

`runner.prepare` (tokenizing, unpacking) runs on the loop only for a small request; a large
one's runs on a thread (`OFF_LOOP_TEXT_CHARS`), since the loop also sends the reports by which
gateways know the worker is alive.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

from sluice import wire
from sluice.clock import Clock
from sluice.engines.base import ItemFailure, ItemOutput, PreparedItem, Runner
from sluice.errors import InvalidInput
from sluice.metrics import WorkerMetrics
from sluice.priority import priority_from_wire
from sluice.scheduler import Batch, Decision, Rejected, RejectReason, Scheduler
from sluice.scheduler.batcher import ModelKey
from sluice.worker.device import DeviceThread
from sluice.worker.model_table import ModelTable
from sluice.worker.outbox import Outbox

log = logging.getLogger("sluice.worker")

OFF_LOOP_TEXT_CHARS = 16_384
OFF_LOOP_TENSOR_BYTES = 1 << 20
"""A request with more text or tensor data than these is prepared on a thread, not on the event
loop, which must keep sending the reports that tell gateways this worker is alive: the demo
embedding model tokenizes under 2 MB of text a second on a small CPU (2048 inputs of 4,000
characters took 4.7 s). Smaller ones are prepared at once, sparing them the hop to a thread."""


@dataclass(slots=True)
class _Pending:
    identity: bytes
    gateway_request_id: int
    key: ModelKey
    items: list[PreparedItem]
    outputs: list[ItemOutput | None]
    errors: list[wire.ItemError] = field(default_factory=list)
    num_left: int = 0
    queue_s: float = 0.0
    exec_s: float = 0.0
    batch_size: int = 0
    device_s: float = 0.0  # its items' shares of their batches' device time, split by cost


@dataclass(slots=True)
class _Preparing:
    """A request whose inputs are being prepared on a thread (`Batches._prepare_off_loop`)."""

    key: ModelKey
    is_withdrawn: bool = False
    """Cancelled meanwhile: dropped unanswered once prepared."""


class Batches:
    """The one-shot requests admitted and not answered yet, and the batches they run in. The
    scheduler is shared with the device thread under `lock`."""

    def __init__(self, scheduler: Scheduler, lock: threading.Lock, clock: Clock, metrics: WorkerMetrics,
                 table: ModelTable, outbox: Outbox, ids: Iterator[int], by_gateway_id: dict[tuple[bytes, int], int],
                 check_drained: Callable[[], None]) -> None:
        """`ids`: the worker's internal request ids; `by_gateway_id`: which one each gateway's
        request got (shared with the worker's generations). `check_drained`: called when a
        request is answered or dropped."""
        self._scheduler = scheduler
        self._lock = lock
        self._clock = clock
        self._metrics = metrics
        self._table = table
        self._outbox = outbox
        self._ids = ids
        self._by_gateway_id = by_gateway_id
        self._check_drained = check_drained
        self.device: DeviceThread | None = None
        """The device thread (`serve` starts it)."""
        self._pending: dict[int, _Pending] = {}
        self._preparing: dict[tuple[bytes, int], _Preparing] = {}
        """Requests being prepared on a thread (`_prepare_off_loop`), by (gateway, its request id)."""
        self._held: asyncio.TimerHandle | None = None
        """Looks again when the scheduler held background work back (`Decision.retry_at`)."""
        self.batch_counts: dict[tuple[str, str, int], tuple[int, float]] = {}
        """(model, version, batch size) -> batches run and their device seconds, since this process started."""
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def is_empty(self) -> bool:
        """No request is being prepared or waits for its answer."""
        return not self._pending and not self._preparing

    def holds(self, key: ModelKey) -> bool:
        """Whether a request to this model version is queued, running or being prepared."""
        with self._lock:
            queued = self._scheduler.queue_state(key)[0]
        return queued > 0 or any(pending.key == key for pending in self._pending.values()) \
            or any(preparing.key == key for preparing in self._preparing.values())

    # -- arrival -------------------------------------------------------------------------------

    def submit(self, identity: bytes, message: wire.Submit, runner: Runner) -> None:
        """Prepare a request to `runner`'s model (on a thread if it is large) and admit it."""
        deadline = self._clock.now() + message.timeout_s  # from arrival: preparing counts against it
        if is_large(message.payload):
            self._prepare_off_loop(identity, message, runner, deadline)
            return
        try:
            items = runner.prepare(message.payload)
        except InvalidInput as exc:
            self._refuse_input(identity, message.request_id, exc)
            return
        self._admit(identity, message, items, deadline)

    def _prepare_off_loop(self, identity: bytes, message: wire.Submit, runner: Runner, deadline: float) -> None:
        """Prepare a large request on a thread (tokenizing 8 MB of text takes seconds, and the loop
        sends the reports that tell gateways this worker is alive), then admit it. Until its thread
        is done it is in `_preparing`: a Cancel marks it withdrawn there, draining waits for it, and
        its version is not freed under it."""
        preparing = self._preparing[(identity, message.request_id)] = _Preparing((message.model, message.version))

        async def prepare() -> None:
            try:
                outcome: list[PreparedItem] | Exception = await asyncio.to_thread(runner.prepare, message.payload)
            except Exception as exc:  # answered below, as the inline path would
                outcome = exc
            self._preparing.pop((identity, message.request_id), None)
            if preparing.is_withdrawn:
                pass  # cancelled meanwhile: nothing to answer
            elif isinstance(outcome, InvalidInput):
                self._refuse_input(identity, message.request_id, outcome)
            elif isinstance(outcome, Exception):
                log.error("preparing request %d for %s failed", message.request_id, message.model, exc_info=outcome)
                self._outbox.reply(identity, wire.Result(message.request_id, wire.Outcome.FAILED,
                                                         errors=[wire.ItemError(-1, f"model error: {outcome}")],
                                                         message=f"model error: {outcome}"))
            elif self._table.runners.get((message.model, message.version)) is not runner:
                missing = f"model {message.model} v{message.version} was taken off this worker"
                self._outbox.reply(identity, wire.Result(message.request_id, wire.Outcome.NOT_FOUND, message=missing))
            else:
                self._admit(identity, message, outcome, deadline)
            self._check_drained()

        task = asyncio.create_task(prepare())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refuse_input(self, identity: bytes, request_id: int, exc: InvalidInput) -> None:
        self._outbox.reply(identity, wire.Result(request_id, wire.Outcome.FAILED,
                                                 errors=[wire.ItemError(-1, exc.message)], message=exc.message))

    def _admit(self, identity: bytes, message: wire.Submit, items: list[PreparedItem], deadline: float) -> None:
        """Queue a prepared request in the scheduler, or answer why not."""
        key = (message.model, message.version)
        if message.trace is not None:  # for a call to another server (`http-single`)
            items = [replace(item, trace=message.trace) for item in items]
        typical_cost = self._table.typical_cost
        if items:
            typical_cost[key] += 0.05 * (items[0].cost - typical_cost[key])
        internal_id = next(self._ids)
        pending = _Pending(identity, message.request_id, key, items, [None] * len(items), num_left=len(items))
        with self._lock:
            decision = self._scheduler.admit(key, internal_id, [item.cost for item in items], deadline,
                                             tenant=message.tenant, priority=priority_from_wire(message.priority),
                                             background=message.background)
            if isinstance(decision, Rejected):
                # turned away for want of capacity (not a tenant's own cap): the demand it carried
                refused_s = self._predicted_s(key, items) if decision.reason is RejectReason.OVERLOADED else 0.0
            else:  # under the lock: the device thread may put the items in the next batch at once
                self._pending[internal_id] = pending
        if isinstance(decision, Rejected):
            if refused_s > 0:
                self._metrics.refused_work(key[0], key[1], refused_s)
            self._outbox.reply(identity, _rejection(message.request_id, decision, message.timeout_s))
            return
        self._by_gateway_id[(identity, message.request_id)] = internal_id
        if not items:
            self._finish(internal_id, pending)
        self.kick()

    def _predicted_s(self, key: tuple[str, str], items: Sequence[PreparedItem]) -> float:
        """The device time `items` would use, each its share of a full batch's fixed cost. The
        caller holds the scheduler's lock."""
        profile = self._scheduler.profile(key)
        share_s = profile.alpha_s / self._table.runners[key].info.max_batch_size
        return sum(share_s + profile.beta_s * item.cost for item in items)

    def withdraw(self, identity: bytes, request_id: int) -> bool:
        """A Cancel for a request being prepared: its preparation ends unanswered. False if it is
        not being prepared."""
        preparing = self._preparing.get((identity, request_id))
        if preparing is None:
            return False
        preparing.is_withdrawn = True
        return True

    def cancel(self, internal_id: int) -> None:
        """A Cancel for an admitted request: out of its queue, and never answered."""
        with self._lock:
            self._scheduler.cancel(internal_id)
        self._pending.pop(internal_id, None)

    # -- the device ----------------------------------------------------------------------------

    def kick(self) -> None:
        """If the device is idle, form the next batch and start it."""
        assert self.device is not None
        with self._lock:
            if not self._scheduler.is_idle or self.device.is_stopping:
                return
            decision = self._scheduler.next_batch()
            prepared = self.prepared_items(decision.batch) if decision.batch is not None else []
        if decision.batch is not None:
            self.device.start(decision.batch, prepared)
        self._on_formed(decision)

    def prepared_items(self, batch: Batch) -> list[PreparedItem | None]:
        """The inputs of a batch's items (None for a request withdrawn meanwhile). Called with the
        lock held, from either thread; `_pending` entries are only added and removed whole."""
        found = []
        for item in batch.items:
            pending = self._pending.get(item.request_id)
            found.append(pending.items[item.index] if pending is not None else None)
        return found

    def _on_formed(self, decision: Decision) -> None:
        """A batch has started (or none could): tell gateways which requests started and which
        expired."""
        for item in decision.expired:
            self._expire(item.request_id)
        batch = decision.batch
        if batch is None:
            if decision.retry_at is not None:
                if self._held is not None:
                    self._held.cancel()
                delay_s = max(decision.retry_at - self._clock.now(), 0.0)
                self._held = asyncio.get_running_loop().call_later(delay_s, self.kick)
            self._check_drained()
            return
        if self._held is not None:  # a batch started before the retry time: nothing to retry
            self._held.cancel()
            self._held = None
        now = self._clock.now()
        started: dict[bytes, list[int]] = {}
        for item in batch.items:
            pending = self._pending.get(item.request_id)
            if pending is not None:
                started.setdefault(pending.identity, []).append(pending.gateway_request_id)
                pending.queue_s = max(pending.queue_s, now - item.enqueued_at)
        for identity, ids in started.items():
            self._outbox.reply(identity, wire.Started(ids))

    def batch_done(self, batch: Batch, outputs: list[ItemOutput | ItemFailure], exec_s: float,
                   next_decision: Decision | None) -> None:
        """Loop thread: a batch finished: answer the requests it completed, and start the next
        batch if the device thread did not. `next_decision`: the batch the device thread started
        next, or None when it found nothing queued and left the batch for this thread to record,
        after the answers have left."""
        now = self._clock.now()
        device_s = batch.device_shares(exec_s)  # as the scheduler splits it in batch_done
        model, version = batch.model
        for item, output in zip(batch.items, outputs, strict=True):
            pending = self._pending.get(item.request_id)
            if pending is None:
                continue  # cancelled or expired while running
            pending.device_s += device_s.pop(item.request_id, 0.0)
            pending.exec_s = max(pending.exec_s, exec_s)
            pending.batch_size = max(pending.batch_size, len(batch.items))
            if isinstance(output, ItemFailure):
                pending.errors.append(wire.ItemError(item.index, output.message, output.is_transient))
                self._metrics.item_failed(model, version)
            else:
                pending.outputs[item.index] = output
            pending.num_left -= 1
            if pending.num_left == 0:
                self._finish(item.request_id, pending)
        if next_decision is None:
            self._outbox.flush()  # the answers leave before the bookkeeping below
            with self._lock:
                self._scheduler.batch_done(batch, exec_s)
        else:
            self._on_formed(next_decision)
        size_key = (model, version, len(batch.items))
        count, total_s = self.batch_counts.get(size_key, (0, 0.0))
        self.batch_counts[size_key] = (count + 1, total_s + exec_s)
        self._metrics.batch_done(model, version, len(batch.items), exec_s,
                                 [max(now - exec_s - item.enqueued_at, 0.0) for item in batch.items])
        self.kick()  # the device thread found nothing: requests that arrived since can start

    def _finish(self, internal_id: int, pending: _Pending) -> None:
        del self._pending[internal_id]
        self._by_gateway_id.pop((pending.identity, pending.gateway_request_id), None)
        num_tokens = sum(item.num_tokens for item in pending.items)
        payload = None
        if not pending.errors:
            try:
                payload = self._table.runners[pending.key].pack([o for o in pending.outputs if o is not None])
            except Exception as exc:  # a model's outputs that do not fit together: fail it, never hang it
                log.warning("%s v%s: request's outputs could not be assembled: %s", *pending.key, exc)
                pending.errors.append(wire.ItemError(-1, f"model error: {exc}"))
        errors = sorted(pending.errors, key=_index)
        result = wire.Result(pending.gateway_request_id, wire.Outcome.FAILED if errors else wire.Outcome.OK,
                             payload=payload, errors=errors, num_tokens=num_tokens, queue_s=pending.queue_s,
                             exec_s=pending.exec_s, batch_size=pending.batch_size, device_s=pending.device_s,
                             message=pending.errors[0].message if errors else "")
        self._outbox.reply(pending.identity, result)

    def _expire(self, internal_id: int) -> None:
        pending = self._pending.pop(internal_id, None)
        if pending is None:
            return
        self._by_gateway_id.pop((pending.identity, pending.gateway_request_id), None)
        self._outbox.reply(pending.identity, wire.Result(
            pending.gateway_request_id, wire.Outcome.EXPIRED,
            message="deadline could not be met; dropped before execution"))


def is_large(payload: wire.Payload) -> bool:
    """Whether preparing it may take long enough to stall the event loop (`OFF_LOOP_TEXT_CHARS`)."""
    if isinstance(payload, wire.TextPayload):
        return sum(len(text) for text in payload.texts) > OFF_LOOP_TEXT_CHARS
    if isinstance(payload, wire.TensorPayload):
        return len(payload.data) > OFF_LOOP_TENSOR_BYTES
    if isinstance(payload, wire.TensorsPayload):
        return sum(len(tensor.data) for tensor in payload.tensors) > OFF_LOOP_TENSOR_BYTES
    return False


def _rejection(request_id: int, rejected: Rejected, timeout_s: float) -> wire.Result:
    """`timeout_s`: what was left of the request's deadline when the gateway sent it."""
    if rejected.reason is RejectReason.DEADLINE_UNREACHABLE:
        return wire.Result(request_id, wire.Outcome.UNREACHABLE,
                           message=f"{timeout_s * 1000:.0f} ms of the request's deadline were left when it reached "
                                   "the worker: less than running it takes, even on an idle device; send fewer "
                                   "or shorter inputs, or a longer deadline (X-Request-Timeout-Ms)")
    return wire.Result(request_id, wire.Outcome.REJECTED, retry_after_s=rejected.retry_after_s,
                       message=f"worker {rejected.reason.value}: queued work would miss the deadline")


def _index(error: wire.ItemError) -> int:
    return error.index
