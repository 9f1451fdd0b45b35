"""The worker's RPC server: receives requests from gateways, and answers them and reports its
state back; a request is run by the part of the worker its model version needs.

    Listener ──frames──▶ _on_message ─┬─ Submit ─▶ Batches (one-shot: scheduler, device thread)
                                      │          ─▶ Generations (generative: its engine's loop)
                                      │          ─▶ UpstreamLoop (an external server)
                                      ├─ Cancel, Hello, Drain, TenantWeights
                                      └─ SyncModel ─▶ ModelSyncer (loads while serving)
    ◀──Outbox (Started, Result, TokenChunk, ModelSynced, WorkerState, BatchStats)

It listens before it loads its models (`ModelSyncer.load_startup`): gateways see it at once, and
the versions it is loading. Every `STATE_INTERVAL_S` it tells each gateway its state (the model
versions it serves, its queues and the waits it predicts): gateways route and admit by it, and
know from it that the worker is alive, so the event loop never blocks (model execution and the
preparation of large requests run on threads).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from sluice import transport, wire
from sluice.clock import Clock
from sluice.engines.base import ItemFailure, ItemOutput
from sluice.errors import ConfigError
from sluice.metrics import WorkerMetrics
from sluice.repository import ModelVersion
from sluice.scheduler import Batch, Decision, Scheduler
from sluice.scheduler.batcher import ModelKey
from sluice.tasks import cancel_and_wait
from sluice.worker.batches import Batches
from sluice.worker.device import DeviceThread
from sluice.worker.generation import GenerationLoop, Generations
from sluice.worker.loading import LoadedModel, ModelSource, warm_up
from sluice.worker.model_table import ModelTable
from sluice.worker.outbox import Outbox
from sluice.worker.syncing import DEFAULT_LOAD_CONCURRENCY, ModelSyncer

if TYPE_CHECKING:
    from sluice.engines.generative.engine import RequestOutput

log = logging.getLogger("sluice.worker")

STATE_INTERVAL_S = 0.05


async def _until_done(main: asyncio.Task[Any], helpers: list[asyncio.Task[None]]) -> None:
    """Wait for `main`; a helper that fails first (a bug in the state reports or in loading at
    start) is raised, so the worker exits and is restarted instead of staying up unheard: with
    no state reports the gateway would send it nothing again, and nothing would restart it."""
    pending: set[asyncio.Task[Any]] = {main, *helpers}
    while not main.done():
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if task is not main and not task.cancelled() and (error := task.exception()) is not None:
                log.critical("worker: its %s failed; exiting to be restarted", task.get_name())
                raise error


class WorkerServer:
    def __init__(
        self,
        worker_id: str,
        models: dict[ModelKey, LoadedModel],
        refused: list[wire.RefusedModel],
        clock: Clock,
        metrics: WorkerMetrics,
        source: ModelSource | None = None,
        dormant: Sequence[ModelVersion] = (),
        memory_budget_bytes: int | None = None,
        startup: Sequence[ModelVersion] = (),
        load_concurrency: int = DEFAULT_LOAD_CONCURRENCY,
    ) -> None:
        """`source`: where to load models from while serving (`SyncModel`, `startup`); None: models
        are fixed. `dormant`: versions it loads on demand, not loaded yet (`[loading] on_demand`).
        `startup`: versions it loads once it listens (reported as loading until then),
        `load_concurrency` at a time, those that fit `memory_budget_bytes` (`ModelSyncer.load_startup`).
        `memory_budget_bytes`: what the models it loads on demand may take with the others
        (`repository.footprint_bytes`); to load one, the least recently used idle ones that can be
        loaded again on demand are unloaded first. None: no bound."""
        self.worker_id = worker_id
        self._clock = clock
        self._metrics = metrics
        self._scheduler = Scheduler(clock)
        self._lock = threading.Lock()  # guards the scheduler and the one-shot runners, shared with the device thread
        self._outbox = Outbox()
        self._table = ModelTable(self._scheduler, self._lock, clock, metrics, self._outbox, self._on_generated,
                                 self._check_drained, {version.key: version for version in dormant})
        self._syncer = ModelSyncer(self._table, clock, refused, source, startup, memory_budget_bytes, self._outbox,
                                   self._broadcast_state, self._holds_work, lambda: self._is_draining,
                                   load_concurrency)
        for key, model in models.items():
            self._table.register(key, model, warm_up(model))
        self._generations = Generations(clock, self._outbox.reply, self._forget, self._metrics.refused_work)
        self._by_gateway_id: dict[tuple[bytes, int], int] = {}
        self._ids = itertools.count(1)
        self._batches = Batches(self._scheduler, self._lock, clock, metrics, self._table, self._outbox, self._ids,
                                self._by_gateway_id, self._check_drained)
        self._gateways: dict[bytes, int] = {}
        """Each gateway heard from, with the highest request id it has sent (`WorkerState.seen_request_id`)."""
        self._is_draining = False
        self._has_loaded = False
        """The versions it starts with are loaded or refused (`not_ready`)."""
        self._drained = asyncio.Event()
        self._busy_s = 0.0
        self._reported_a_wait = False
        """The last report predicted some wait: going idle is news worth a report of its own."""
        self._incarnation = f"{os.getpid()}-{time.time_ns()}"

    # -- lifecycle -----------------------------------------------------------------------------

    async def serve(self, address: str, on_listening: Callable[[], None] = lambda: None) -> None:
        """Listen at `address` until drained; `on_listening` is called once gateways can connect."""
        device = self._batches.device = DeviceThread(self._scheduler, self._lock, self._table.runners,
                                                     self._batches.prepared_items, self._on_batch_done,
                                                     asyncio.get_running_loop())
        for key in [*self._table.generators, *self._table.upstreams]:
            await self._table.attach(key)
        try:
            listener = self._outbox.listener = await transport.Listener.start(address, self._on_frame)
        except OSError as exc:  # another worker has it, or no such interface here
            device.stop()
            raise ConfigError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
        log.info("worker %s listening at %s with %d models, %d to load", self.worker_id, address,
                 len(self._table.runners), len(self._syncer.loading))
        on_listening()
        ticker = asyncio.create_task(self._state_loop(), name="state reports")
        loader = asyncio.create_task(self._load_at_start(), name="loading at start")
        drained = asyncio.create_task(self._drained.wait())
        try:
            await _until_done(drained, [ticker, loader])
            self._broadcast_state()
            self._outbox.flush()
        finally:
            await cancel_and_wait([ticker, loader, drained])
            device.stop()
            await self._table.aclose()
            await listener.aclose()  # closing flushes what is still buffered

    async def _load_at_start(self) -> None:
        await self._syncer.load_startup()
        self._has_loaded = True

    def not_ready(self) -> str | None:
        """Why a readiness probe should not send it traffic yet (or any more): None once the
        versions it starts with are loaded or refused, until it drains (`worker.probes`). Called
        from the probes' thread: it reads two flags."""
        if self._is_draining:
            return "draining"
        return None if self._has_loaded else "loading its models"

    def drain(self) -> None:
        """Stop admitting; exit once every admitted request has been answered."""
        self._is_draining = True
        self._broadcast_state()  # gateways stop sending work now, not at the next report
        self._check_drained()

    def _check_drained(self) -> None:
        if not self._is_draining:
            return
        with self._lock:
            is_idle = self._scheduler.is_idle
        is_idle = is_idle and all(upstream.is_idle for upstream in self._table.upstream_loops.values())
        if self._batches.is_empty and not self._generations and is_idle:
            self._drained.set()

    def _holds_work(self, key: ModelKey) -> bool:
        if key in self._table.runners:
            return self._batches.holds(key)
        if key in self._table.generators:
            return self._generations.holds(key)
        upstream = self._table.upstream_loops.get(key)
        return upstream is not None and not upstream.is_idle

    # -- messages in ---------------------------------------------------------------------------

    def _on_frame(self, identity: bytes, data: bytes) -> None:
        try:
            messages = wire.decode(data)
        except Exception:  # a malformed frame from a peer; never crash the worker for it
            log.warning("dropping an undecodable message from a gateway")
            return
        for message in messages:
            self._on_message(identity, message)

    def _on_message(self, identity: bytes, message: wire.Message) -> None:
        if isinstance(message, wire.Submit):
            self._on_submit(identity, message)
        elif isinstance(message, wire.Cancel):
            self._on_cancel(identity, message)
        elif isinstance(message, wire.Hello):
            self._gateways.setdefault(identity, 0)
            self._outbox.reply(identity, self._state_for(identity, self._state()))
        elif isinstance(message, wire.Drain):
            self.drain()
        elif isinstance(message, wire.SyncModel):
            self._syncer.on_sync(identity, message)
        elif isinstance(message, wire.TenantWeights):
            try:
                self._table.set_tenant_weights(message.weights)
            except ValueError as exc:
                log.warning("ignoring tenant weights from a gateway: %s", exc)

    def _on_submit(self, identity: bytes, message: wire.Submit) -> None:
        if message.request_id > self._gateways.get(identity, 0):
            self._gateways[identity] = message.request_id
        key = (message.model, message.version)
        if key in self._table.last_used:
            self._table.last_used[key] = self._clock.now()
        runner = self._table.runners.get(key)
        generation_loop = self._table.generation_loops.get(key)
        upstream = self._table.upstream_loops.get(key)
        if runner is None and generation_loop is None and upstream is None:
            missing = f"model {message.model} v{message.version} is not on this worker"
            self._outbox.reply(identity, wire.Result(message.request_id, wire.Outcome.NOT_FOUND, message=missing))
            return
        if self._is_draining:
            self._outbox.reply(identity, wire.Result(message.request_id, wire.Outcome.DRAINING, retry_after_s=1.0,
                                                     message="worker is draining"))
            return
        if generation_loop is not None:
            self._on_generate(identity, message, generation_loop)
            return
        if upstream is not None:
            upstream.submit(identity, message)
            return
        assert runner is not None
        self._batches.submit(identity, message, runner)

    def _on_generate(self, identity: bytes, message: wire.Submit, generation_loop: GenerationLoop) -> None:
        internal_id = next(self._ids)
        if self._generations.submit(internal_id, identity, message, generation_loop):
            self._by_gateway_id[(identity, message.request_id)] = internal_id

    def _on_generated(self, outputs: list[RequestOutput], step_s: float, tokens: dict[str, int]) -> None:
        """Loop thread: one engine step's output (see `Generations.on_outputs`). A step that
        computed tokens kept the device busy, as a batch does."""
        if tokens:
            self._busy_s += step_s
            self._metrics.device_busy(step_s)
        self._generations.on_outputs(outputs, step_s, tokens)
        self._check_drained()

    def _forget(self, identity: bytes, gateway_request_id: int) -> None:
        """A generation was answered (perhaps outside an engine step: a prompt prepared off the loop)."""
        self._by_gateway_id.pop((identity, gateway_request_id), None)
        self._check_drained()

    def _on_cancel(self, identity: bytes, message: wire.Cancel) -> None:
        for request_id in message.request_ids:
            if any(upstream.cancel(identity, request_id) for upstream in self._table.upstream_loops.values()):
                continue
            if self._batches.withdraw(identity, request_id):
                continue  # its preparation ends unanswered
            internal_id = self._by_gateway_id.pop((identity, request_id), None)
            if internal_id is None or self._generations.cancel(internal_id):
                continue
            self._batches.cancel(internal_id)
        self._check_drained()

    def _on_batch_done(self, batch: Batch, outputs: list[ItemOutput | ItemFailure], exec_s: float,
                       next_decision: Decision | None) -> None:
        """Loop thread: a batch finished (`Batches.batch_done`)."""
        self._batches.batch_done(batch, outputs, exec_s, next_decision)
        self._busy_s += exec_s
        if self._scheduler.is_idle and self._reported_a_wait:
            # nothing left to run: say so now rather than at the next report, so that no gateway
            # keeps counting, for up to a report interval, a wait its last report predicted (at
            # most one such report per periodic one: the last one that predicted a wait)
            self._broadcast_state()
        self._check_drained()

    # -- state reports -------------------------------------------------------------------------

    def _state(self) -> wire.WorkerState:
        table = self._table
        queues = []
        with self._lock:
            for key in self._scheduler.models():
                depth, work = self._scheduler.queue_state(key)
                profile = self._scheduler.profile(key)
                max_batch = table.runners[key].info.max_batch_size
                item_s = profile.alpha_s / max_batch + profile.beta_s * table.typical_cost[key]
                newcomer_s = self._scheduler.newcomer_s(key, round(table.typical_cost[key]))
                queues.append(wire.QueueState(key[0], key[1], depth, work, item_s, newcomer_s,
                                              profile.is_provisional))
            work_ahead_s, drain_rate = self._scheduler.work_ahead_s(), self._scheduler.drain_rate
            report = self._scheduler.wait_report()
        waits = [wire.WaitState(int(c.priority), c.newcomer_wait_s) for c in report.classes]
        waits += [wire.WaitState(int(t.priority), t.wait_s, t.tenant) for t in report.tenants]
        return wire.WorkerState(
            worker_id=self.worker_id,
            incarnation=self._incarnation,
            is_ready=not self._is_draining,
            is_draining=self._is_draining,
            models=list(table.infos.values()),
            refused=self._syncer.reported_refused(),  # not those being loaded again
            queues=queues,
            work_ahead_s=work_ahead_s,
            drain_rate=drain_rate,
            waits=waits,
            upstreams=[upstream.load() for upstream in table.upstream_loops.values()],
            dormant=sorted(table.dormant),
            loading=sorted(self._syncer.loading),
        )

    def _send_batch_stats(self) -> None:
        """Every gateway gets the batches run so far (cumulative: a report that is lost costs nothing)."""
        if not self._batches.batch_counts:
            return
        counts = [wire.BatchCount(model, version, size, count, total_s)
                  for (model, version, size), (count, total_s) in self._batches.batch_counts.items()]
        stats = wire.BatchStats(self.worker_id, self._incarnation, counts)
        for identity in self._gateways:
            self._outbox.reply(identity, stats)

    def _state_for(self, identity: bytes, state: wire.WorkerState) -> wire.WorkerState:
        return msgspec.structs.replace(state, seen_request_id=self._gateways.get(identity, 0))

    def _broadcast_state(self) -> None:
        state = self._state()
        self._reported_a_wait = state.work_ahead_s > 0 or any(wait.wait_s > 0 for wait in state.waits)
        for identity in self._gateways:
            self._outbox.reply(identity, self._state_for(identity, state))

    async def _state_loop(self) -> None:
        last_busy, last_at, ratio = 0.0, time.monotonic(), 0.0
        ticks = itertools.count()
        while True:
            await asyncio.sleep(STATE_INTERVAL_S)
            for upstream in self._table.upstream_loops.values():
                upstream.expire()
            self._syncer.unload_idle()
            if self._table.retiring:
                self._syncer.free_retired()
            self._broadcast_state()
            if next(ticks) % 10 == 0:
                self._send_batch_stats()
                now = time.monotonic()
                sample = min((self._busy_s - last_busy) / max(now - last_at, 1e-6), 1.0)
                ratio = sample if ratio == 0 else 0.5 * ratio + 0.5 * sample
                last_busy, last_at = self._busy_s, now
                self._metrics.busy_ratio(ratio)
                self._report_metrics()

    def _report_metrics(self) -> None:
        """The gauges of the queues, latency profiles, engines and upstreams, every tenth report."""
        with self._lock:
            snapshot = [(key, *self._scheduler.queue_state(key), self._scheduler.profile(key))
                        for key in self._scheduler.models()]
        for (model, version), depth, work, profile in snapshot:
            self._metrics.queue(model, version, depth, work)
            self._metrics.profile(model, version, profile.alpha_s, profile.beta_s)
        if self._table.generators:
            self._metrics.engines({key: generator.engine.stats()
                                   for key, generator in self._table.generators.items()})
        if self._table.upstream_loops:
            loads = [upstream.load() for upstream in self._table.upstream_loops.values()]
            self._metrics.upstreams((load.model, load.num_running, load.num_waiting) for load in loads)
