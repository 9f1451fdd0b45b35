"""The worker's RPC server: receives requests from gateways, queues them in the scheduler and
runs batches on a dedicated device thread, so the event loop never blocks.

    Listener ─────Submit──▶ runner.prepare ──▶ scheduler.admit ──▶ queue
                                                                      │ device free
    ◀──Started── ◀── scheduler.next_batch ◀───────────────────────────┘
    ◀──Result──── gather per request ◀── device thread: runner.run_batch

`runner.prepare` (tokenizing, unpacking) runs on the loop only for a small request; a large
one's runs on a thread (`OFF_LOOP_TEXT_CHARS`), since the loop also sends the reports by which
gateways know the worker is alive.

It listens before it loads its models (`startup`): gateways see it at once, and the versions it
is loading (`WorkerState.loading`), each served as soon as it is loaded and warmed up.
Models can change while it serves (`SyncModel`, `_sync`): new versions are loaded and warmed up
on a thread (`worker.loading`, each within its `[loading] timeout_s`) and then registered;
versions taken off stop being reported at once and are freed once they have answered what they hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from sluice import transport, wire
from sluice.clock import Clock
from sluice.engines.base import ItemFailure, ItemOutput, PreparedItem, Runner
from sluice.engines.generative.engine import RequestOutput
from sluice.engines.generative.runner import GenerativeRunner
from sluice.engines.openai_upstream import OpenAIUpstreamRunner
from sluice.errors import ConfigError, InvalidInput
from sluice.metrics import WorkerMetrics
from sluice.priority import Priority
from sluice.repository import ModelVersion, footprint_bytes
from sluice.scheduler import Batch, Decision, LatencyProfile, Rejected, RejectReason, Scheduler
from sluice.scheduler.batcher import ModelKey
from sluice.worker.device import DeviceThread
from sluice.worker.generation import GenerationLoop, Generations
from sluice.worker.loading import Loaded, LoadedModel, ModelSource, RepositoryModel, VersionLoad, warm_up
from sluice.worker.upstream import UpstreamLoop

log = logging.getLogger("sluice.worker")

STATE_INTERVAL_S = 0.05

EVICTION_WAIT_S = 5.0
"""How long a load waits for versions taken off to be freed (they finish what they hold): those a load
on demand evicted, or an unloaded version whose files changed before it is loaded again."""
OFF_LOOP_TEXT_CHARS = 16_384
OFF_LOOP_TENSOR_BYTES = 1 << 20
"""A request with more text or tensor data than these is prepared on a thread, not on the event
loop, which must keep sending the reports that tell gateways this worker is alive: the demo
embedding model tokenizes under 2 MB of text a second on a small CPU (2048 inputs of 4,000
characters took 4.7 s). Smaller ones are prepared at once, sparing them the hop to a thread."""
RETIRE_AFTER_S = 0.5
"""A version taken off (`SyncModel`) still takes the requests sent before the gateways heard it
was (its report goes out at once, so within a few ms); it is freed once idle and this long after."""


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
    """A request whose inputs are being prepared on a thread (`WorkerServer._prepare_off_loop`)."""

    key: ModelKey
    is_withdrawn: bool = False
    """Cancelled meanwhile: dropped unanswered once prepared."""


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
    ) -> None:
        """`source`: where to load models from while serving (`SyncModel`, `startup`); None: models
        are fixed. `dormant`: versions it loads on demand, not loaded yet (`[loading] on_demand`).
        `startup`: versions it loads once it listens (reported as loading until then).
        `memory_budget_bytes`: what the models it loads on demand may take with the others
        (`repository.footprint_bytes`); to load one, the least recently used idle ones that can be
        loaded again on demand are unloaded first. None: no bound."""
        self.worker_id = worker_id
        self._generators: dict[ModelKey, GenerativeRunner] = {}
        self._upstreams: dict[ModelKey, OpenAIUpstreamRunner] = {}
        self._runners: dict[ModelKey, Runner] = {}
        self._infos: dict[ModelKey, wire.ModelInfo] = {}
        self._typical_cost: dict[ModelKey, float] = {}
        self._refused = refused
        self._source = source
        self._version_load = None if source is None else VersionLoad(source)
        self._startup = list(startup)
        self._loading: set[ModelKey] = {version.key for version in startup}
        """Versions being loaded (`WorkerState.loading`)."""
        self._reserved_bytes = 0
        """Memory set aside, within the budget, for the loads under way (`_reserve`)."""
        self._retiring: dict[ModelKey, tuple[wire.ModelInfo, float]] = {}
        """Versions taken off: their info, and the earliest time they may be freed."""
        self._dormant: dict[ModelKey, ModelVersion] = {version.key: version for version in dormant}
        """Versions loaded on demand (a `SyncModel` from a gateway that got a request for one)."""
        self._versions: dict[ModelKey, ModelVersion] = {}
        self._footprints: dict[ModelKey, int] = {}
        self._memory_budget = memory_budget_bytes
        self._last_used: dict[ModelKey, float] = {}
        """When each loaded version last got a request (or was loaded): for `[loading] idle_unload_s`."""
        self._sync_locks: dict[str, asyncio.Lock] = {}
        """One `SyncModel` at a time per model: a slow load does not hold up another model's load or unload."""
        self._room_lock = asyncio.Lock()
        """Held by a load within the memory budget while it makes room and sets its memory aside
        (`_reserve`): two at once would both count the same free memory."""
        self._freed = asyncio.Event()
        """Set for a moment each time a version taken off is freed."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._tenant_weights: dict[str, float] | None = None
        self._clock = clock
        self._metrics = metrics
        self._scheduler = Scheduler(clock)
        self._lock = threading.Lock()  # guards the scheduler and `_runners`, shared with the device thread
        for key, model in models.items():
            self._register(key, model, warm_up(model))
        self._generation_loops: dict[ModelKey, GenerationLoop] = {}
        self._upstream_loops: dict[ModelKey, UpstreamLoop] = {}
        self._generations = Generations(clock, self._reply, self._forget, self._metrics.refused_work)
        self._pending: dict[int, _Pending] = {}
        self._preparing: dict[tuple[bytes, int], _Preparing] = {}
        """Requests being prepared on a thread (`_prepare_off_loop`), by (gateway, its request id)."""
        self._by_gateway_id: dict[tuple[bytes, int], int] = {}
        self._ids = itertools.count(1)
        self._gateways: dict[bytes, int] = {}
        """Each gateway heard from, with the highest request id it has sent (`WorkerState.seen_request_id`)."""
        self._device: DeviceThread | None = None
        self._held: asyncio.TimerHandle | None = None
        """Looks again when the scheduler held background work back (`Decision.retry_at`)."""
        self._is_draining = False
        self._drained = asyncio.Event()
        self._busy_s = 0.0
        self._reported_a_wait = False
        """The last report predicted some wait: going idle is news worth a report of its own."""
        self._listener: transport.Listener | None = None
        self._outbox: dict[bytes, list[wire.Message]] = {}
        self._incarnation = f"{os.getpid()}-{time.time_ns()}"
        self._batch_counts: dict[tuple[str, str, int], tuple[int, float]] = {}
        """(model, version, batch size) -> batches run and their device seconds, since this process started."""

    # -- lifecycle -----------------------------------------------------------------------------

    async def serve(self, address: str, on_listening: Callable[[], None] = lambda: None) -> None:
        """Listen at `address` until drained; `on_listening` is called once gateways can connect."""
        self._device = DeviceThread(self._scheduler, self._lock, self._runners, self._prepared_items,
                                    self._on_batch_done, asyncio.get_running_loop())
        for key in [*self._generators, *self._upstreams]:
            await self._attach(key)
        try:
            self._listener = await transport.Listener.start(address, self._on_frame)
        except OSError as exc:  # another worker has it, or no such interface here
            self._device.stop()
            raise ConfigError(f"cannot listen on {address}: {exc.strerror or exc}") from exc
        log.info("worker %s listening at %s with %d models, %d to load", self.worker_id, address,
                 len(self._runners), len(self._loading))
        on_listening()
        ticker = asyncio.create_task(self._state_loop())
        loader = asyncio.create_task(self._load_startup())
        try:
            await self._drained.wait()
            self._broadcast_state()
            self._flush()
        finally:
            for task in (ticker, loader):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._device.stop()
            for upstream in self._upstream_loops.values():
                await upstream.aclose()
            for generation_loop in self._generation_loops.values():
                generation_loop.stop()
            for runner in self._runners.values():
                runner.close()
            for generator in self._generators.values():
                generator.close()
            await self._listener.aclose()  # closing flushes what is still buffered

    # -- models --------------------------------------------------------------------------------

    def _register(self, key: ModelKey, model: LoadedModel, timings: list[tuple[int, float]]) -> None:
        """Serve a loaded, warmed-up model version (its engine's loop starts in `_attach`)."""
        runner = model.runner
        if isinstance(runner, GenerativeRunner):
            self._generators[key] = runner
            self._metrics.engine_started(*key, runner.engine.stats())
        elif isinstance(runner, OpenAIUpstreamRunner):
            self._upstreams[key] = runner
        else:
            alpha, beta, ref = runner.prior()
            # measured warm-up batches outweigh the runner's guess; with none, the prior stands
            profile = LatencyProfile(alpha, beta, ref, prior_weight=0.5 if timings else 4.0)
            for cost, seconds in timings:
                profile.observe(cost, seconds)
            with self._lock:
                self._scheduler.add_model(key, model.version.batching, profile)
                self._runners[key] = runner
            self._typical_cost[key] = float(ref)
        self._infos[key] = msgspec.structs.replace(runner.info, routing=model.version.routing)
        self._versions[key] = model.version
        self._footprints[key] = model.footprint_bytes
        self._last_used[key] = self._clock.now()
        self._dormant.pop(key, None)

    async def _attach(self, key: ModelKey) -> None:
        """Start the loop of a generative or upstream model version registered while not serving."""
        loop = asyncio.get_running_loop()
        if key in self._generators and key not in self._generation_loops:
            generation_loop = self._generation_loops[key] = GenerationLoop(self._generators[key], self._on_generated,
                                                                           loop)
            if self._tenant_weights is not None:
                generation_loop.set_tenant_weights(self._tenant_weights)
        if key in self._upstreams and key not in self._upstream_loops:
            upstream = self._upstream_loops[key] = UpstreamLoop(self._upstreams[key], self._reply, self._clock,
                                                                self._check_drained)
            if self._tenant_weights is not None:
                upstream.set_tenant_weights(self._tenant_weights)
            await upstream.start()

    async def _load_startup(self) -> None:
        """Load the versions the worker starts with, one at a time, each served once it is ready;
        one that fails or runs past its timeout is refused alone. A `SyncModel` that came first
        has loaded (or unloaded) its model's: they are no longer `_loading`, and skipped."""
        for version in self._startup:
            if self._is_draining:
                break
            assert self._version_load is not None
            async with self._sync_locks.setdefault(version.name, asyncio.Lock()):
                if version.key not in self._loading:
                    continue
                outcome = await self._version_load.load(version)
                self._loading.discard(version.key)
                if isinstance(outcome, Loaded):
                    self._register(version.key, outcome.model, outcome.timings)
                    await self._attach(version.key)
                    log.info("serving %s v%s", *version.key)
                else:
                    self._refused.append(outcome)
            self._broadcast_state()
        self._startup = []

    def _on_sync(self, identity: bytes, message: wire.SyncModel) -> None:
        task = asyncio.create_task(self._sync(identity, message))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sync(self, identity: bytes, message: wire.SyncModel) -> None:
        """Bring `message.model` in line with the repository (`wire.SyncModel`): its new versions are
        loaded and warmed up on a thread while everything else keeps serving (other models' loads
        and unloads included)."""
        name = message.model
        async with self._sync_locks.setdefault(name, asyncio.Lock()):
            found = await self._bring_in_line(name, message.unload)
            versions = [version for model, version in self._infos if model == name]
            refused = [r for r in self._refused if r.name == name]
            refused += [r for r in found if r not in refused]  # a served version's settings now broken too
            self._reply(identity, wire.ModelSynced(message.sync_id, name, versions, refused))

    async def _bring_in_line(self, name: str, unload: bool) -> list[wire.RefusedModel]:
        """`_sync`'s work; the refusals of `name`'s versions it met."""
        if self._source is None or self._version_load is None or self._is_draining:
            return []
        found = RepositoryModel([], [], [])
        loaded: dict[ModelKey, Loaded] = {}
        refused: list[wire.RefusedModel] = []
        # under the model's lock, what is `_loading` of it waits for `_load_startup`: loaded here, or not at all
        waiting = {key for key in self._loading if key[0] == name}
        if unload:
            self._loading -= waiting
        else:
            found = await asyncio.to_thread(self._source.scan, name)
            # a version taken off (an unload just before) is served again as it was loaded, unless
            # its files or settings changed since: then it is loaded anew, once the old one is freed
            await self._until_freed([version.key for version in found.present if version.key in self._retiring
                                     and self._versions[version.key].revision != version.revision])
            held = {key for key in (*self._infos, *self._retiring) if key[0] == name}
            wanted = [version for version in found.present if version.key not in held]
            reserved = await self._reserve(name, wanted)
            if isinstance(reserved, str):  # no room: it stays as it is (to load on demand: the next request tries)
                log.warning("not loading %s: %s", name, reserved)
                return [wire.RefusedModel(name, version.version, reserved) for version in wanted]
            self._loading -= waiting  # those the repository still has are in `wanted`
            self._loading |= {version.key for version in wanted}
            self._broadcast_state()
            try:
                for version in wanted:
                    outcome = await self._version_load.load(version)
                    if isinstance(outcome, Loaded):
                        loaded[version.key] = outcome
                    else:
                        refused.append(outcome)
            finally:
                self._loading -= {version.key for version in wanted}
                self._reserved_bytes -= reserved
        self._take(name, found, loaded, refused)
        for key in loaded:
            await self._attach(key)
        self._broadcast_state()  # gateways route to what was added, and not to what was taken off
        return found.refused + refused

    def _take(self, name: str, found: RepositoryModel, loaded: dict[ModelKey, Loaded],
              refused: list[wire.RefusedModel]) -> None:
        """Serve the versions `loaded`; take off the versions of `name` the repository (`found`) no
        longer has."""
        present = set(found.versions)
        for key in [key for key in self._retiring if key[0] == name and key[1] in present]:
            self._infos[key] = self._retiring.pop(key)[0]  # back before it was freed
            self._last_used[key] = self._clock.now()
        for key in [key for key in self._dormant if key[0] == name]:
            del self._dormant[key]  # loaded below, gone from the repository, or unloaded
        for key in [key for key in self._infos if key[0] == name and key[1] not in present]:
            self._retire(key)
            log.info("taking %s v%s off: it is freed once it has answered what it holds", *key)
        for key, outcome in loaded.items():
            self._register(key, outcome.model, outcome.timings)
            log.info("serving %s v%s, loaded while serving", *key)
        served = {version for model, version in self._infos if model == name}
        self._refused = [r for r in self._refused if r.name != name] + \
                        [r for r in found.refused + refused if r.version not in served]

    async def _reserve(self, name: str, wanted: list[ModelVersion]) -> int | str:
        """Within the memory budget, set memory aside for loading `wanted` (versions of `name`),
        first unloading the least recently used idle versions of other models that load on
        demand again, and waiting until they are freed. The bytes set aside (the caller gives them
        back once its load is done), or why the budget cannot hold them even so. Loads that run
        at once each count what the others set aside: they cannot overfill it together."""
        if self._memory_budget is None or not wanted:
            return 0
        async with self._room_lock:
            return await self._make_room(name, wanted)

    async def _make_room(self, name: str, wanted: list[ModelVersion]) -> int | str:
        """`_reserve`'s work, under `_room_lock`."""
        assert self._memory_budget is not None
        needed = await asyncio.to_thread(lambda: sum(footprint_bytes(version) for version in wanted))  # reads files
        held = sum(self._footprints.values()) + self._reserved_bytes  # retiring versions too, until they are freed
        evicted = []
        for key in sorted(self._infos, key=lambda k: self._last_used.get(k, 0.0)):
            if held + needed <= self._memory_budget:
                break
            version = self._versions.get(key)
            if key[0] != name and version is not None and not self._holds_work(key) \
                    and (version.loading.on_demand or version.loading.idle_unload_s):
                held -= self._footprints.get(key, 0)
                evicted.append(key)
        if held + needed > self._memory_budget:
            mb = 1024 * 1024
            if needed > self._memory_budget:
                return f"its versions take about {needed / mb:.1f} MB, more than the worker's model memory " \
                       f"budget of {self._memory_budget / mb:.1f} MB"
            return f"its versions take about {needed / mb:.1f} MB and the models in use (or being loaded) " \
                   f"hold {held / mb:.1f} MB of the worker's {self._memory_budget / mb:.1f} MB budget"
        for key in evicted:
            self._retire(key, dormant=True)
            log.info("unloading %s v%s, the least recently used, to make room for %s", *key, name)
        if evicted:
            self._broadcast_state()
            await self._until_freed(evicted)
        self._reserved_bytes += needed
        return needed

    async def _until_freed(self, keys: list[ModelKey]) -> None:
        """Wait, up to `EVICTION_WAIT_S`, until the versions `keys` taken off are freed: at a state
        tick once they hold no work (`_free_retired` sets `_freed`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EVICTION_WAIT_S
        while any(key in self._retiring for key in keys) and (left_s := deadline - loop.time()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._freed.wait(), left_s)

    def _unload_idle(self) -> None:
        """Take off the versions idle for longer than their `[loading] idle_unload_s`; they are
        loaded again on demand."""
        now = self._clock.now()
        for key, version in list(self._versions.items()):
            idle_s = version.loading.idle_unload_s
            if idle_s and key in self._infos and now - self._last_used.get(key, now) > idle_s \
                    and not self._holds_work(key):
                self._retire(key, dormant=True)
                log.info("taking %s v%s off after %.0f s without a request: it loads again on demand", *key, idle_s)

    def _retire(self, key: ModelKey, *, dormant: bool = False) -> None:
        """Stop reporting a served version; it is freed once it holds no work (`_free_retired`).
        `dormant`: it is loaded again on demand."""
        self._retiring[key] = (self._infos.pop(key), self._clock.now() + RETIRE_AFTER_S)
        if dormant:
            self._dormant[key] = self._versions[key]

    def _free_retired(self) -> None:
        """Free the versions taken off that have answered everything they held."""
        now = self._clock.now()
        for key, (_, not_before) in list(self._retiring.items()):
            if now >= not_before and not self._holds_work(key):
                del self._retiring[key]
                self._free(key)
                self._freed.set()  # wakes those waiting (`_make_room`) ...
                self._freed.clear()  # ... and the next wait waits for the next

    def _holds_work(self, key: ModelKey) -> bool:
        if key in self._runners:
            with self._lock:
                queued = self._scheduler.queue_state(key)[0]
            return queued > 0 or any(pending.key == key for pending in self._pending.values()) \
                or any(preparing.key == key for preparing in self._preparing.values())
        if key in self._generators:
            return self._generations.holds(key)
        upstream = self._upstream_loops.get(key)
        return upstream is not None and not upstream.is_idle

    def _free(self, key: ModelKey) -> None:
        runner = self._runners.get(key)
        if runner is not None:
            with self._lock:
                self._scheduler.remove_model(key)
                del self._runners[key]
            runner.close()
        generator = self._generators.pop(key, None)
        if generator is not None:
            generation_loop = self._generation_loops.pop(key, None)
            if generation_loop is not None:
                generation_loop.stop()  # its engine has nothing left: the thread ends at once
            generator.close()
        if self._upstreams.pop(key, None) is not None:
            upstream = self._upstream_loops.pop(key, None)
            if upstream is not None:
                task = asyncio.create_task(upstream.aclose())
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self._typical_cost.pop(key, None)
        self._versions.pop(key, None)
        self._footprints.pop(key, None)
        self._last_used.pop(key, None)
        log.info("unloaded %s v%s", *key)

    def drain(self) -> None:
        """Stop admitting; exit once every admitted request has been answered."""
        self._is_draining = True
        self._broadcast_state()  # gateways stop sending work now, not at the next report
        self._check_drained()

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
            self._reply(identity, self._state_for(identity, self._state()))
        elif isinstance(message, wire.Drain):
            self.drain()
        elif isinstance(message, wire.SyncModel):
            self._on_sync(identity, message)
        elif isinstance(message, wire.TenantWeights):
            self._tenant_weights = message.weights
            try:
                with self._lock:
                    self._scheduler.set_tenant_weights(message.weights)
                for generation_loop in self._generation_loops.values():
                    generation_loop.set_tenant_weights(message.weights)
                for upstream in self._upstream_loops.values():
                    upstream.set_tenant_weights(message.weights)
            except ValueError as exc:
                log.warning("ignoring tenant weights from a gateway: %s", exc)

    def _on_submit(self, identity: bytes, message: wire.Submit) -> None:
        if message.request_id > self._gateways.get(identity, 0):
            self._gateways[identity] = message.request_id
        key = (message.model, message.version)
        if key in self._last_used:
            self._last_used[key] = self._clock.now()
        runner = self._runners.get(key)
        generation_loop = self._generation_loops.get(key)
        upstream = self._upstream_loops.get(key)
        if runner is None and generation_loop is None and upstream is None:
            missing = f"model {message.model} v{message.version} is not on this worker"
            self._reply(identity, wire.Result(message.request_id, wire.Outcome.NOT_FOUND, message=missing))
            return
        if self._is_draining:
            self._reply(identity, wire.Result(message.request_id, wire.Outcome.DRAINING, retry_after_s=1.0,
                                              message="worker is draining"))
            return
        if generation_loop is not None:
            self._on_generate(identity, message, generation_loop)
            return
        if upstream is not None:
            upstream.submit(identity, message)
            return
        assert runner is not None
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
                self._reply(identity, wire.Result(message.request_id, wire.Outcome.FAILED,
                                                  errors=[wire.ItemError(-1, f"model error: {outcome}")],
                                                  message=f"model error: {outcome}"))
            elif self._runners.get((message.model, message.version)) is not runner:
                missing = f"model {message.model} v{message.version} was taken off this worker"
                self._reply(identity, wire.Result(message.request_id, wire.Outcome.NOT_FOUND, message=missing))
            else:
                self._admit(identity, message, outcome, deadline)
            self._check_drained()

        task = asyncio.create_task(prepare())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refuse_input(self, identity: bytes, request_id: int, exc: InvalidInput) -> None:
        self._reply(identity, wire.Result(request_id, wire.Outcome.FAILED,
                                          errors=[wire.ItemError(-1, exc.message)], message=exc.message))

    def _admit(self, identity: bytes, message: wire.Submit, items: list[PreparedItem], deadline: float) -> None:
        """Queue a prepared request in the scheduler, or answer why not."""
        key = (message.model, message.version)
        if items:
            self._typical_cost[key] += 0.05 * (items[0].cost - self._typical_cost[key])
        internal_id = next(self._ids)
        pending = _Pending(identity, message.request_id, key, items, [None] * len(items), num_left=len(items))
        with self._lock:
            decision = self._scheduler.admit(key, internal_id, [item.cost for item in items], deadline,
                                             tenant=message.tenant, priority=_priority(message.priority),
                                             background=message.background)
            if isinstance(decision, Rejected):
                # turned away for want of capacity (not a tenant's own cap): the demand it carried
                refused_s = self._predicted_s(key, items) if decision.reason is RejectReason.OVERLOADED else 0.0
            else:  # under the lock: the device thread may put the items in the next batch at once
                self._pending[internal_id] = pending
        if isinstance(decision, Rejected):
            if refused_s > 0:
                self._metrics.refused_work(key[0], key[1], refused_s)
            self._reply(identity, _rejection(message.request_id, decision, message.timeout_s))
            return
        self._by_gateway_id[(identity, message.request_id)] = internal_id
        if not items:
            self._finish(internal_id, pending)
        self._kick()

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
            if any(upstream.cancel(identity, request_id) for upstream in self._upstream_loops.values()):
                continue
            preparing = self._preparing.get((identity, request_id))
            if preparing is not None:
                preparing.is_withdrawn = True  # its preparation ends unanswered
                continue
            internal_id = self._by_gateway_id.pop((identity, request_id), None)
            if internal_id is None or self._generations.cancel(internal_id):
                continue
            with self._lock:
                self._scheduler.cancel(internal_id)
            self._pending.pop(internal_id, None)
        self._check_drained()

    # -- the device ----------------------------------------------------------------------------

    def _kick(self) -> None:
        """If the device is idle, form the next batch and start it."""
        assert self._device is not None
        with self._lock:
            if not self._scheduler.is_idle or self._device.is_stopping:
                return
            decision = self._scheduler.next_batch()
            prepared = self._prepared_items(decision.batch) if decision.batch is not None else []
        if decision.batch is not None:
            self._device.start(decision.batch, prepared)
        self._on_formed(decision)

    def _prepared_items(self, batch: Batch) -> list[PreparedItem | None]:
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
                self._held = asyncio.get_running_loop().call_later(delay_s, self._kick)
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
            self._reply(identity, wire.Started(ids))

    def _on_batch_done(self, batch: Batch, outputs: list[ItemOutput | ItemFailure], exec_s: float,
                       next_decision: Decision | None) -> None:
        """Loop thread: a batch finished. `next_decision`: the batch the device thread started
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
            self._flush()  # the answers leave before the bookkeeping below
            with self._lock:
                self._scheduler.batch_done(batch, exec_s)
        else:
            self._on_formed(next_decision)
        self._busy_s += exec_s
        size_key = (model, version, len(batch.items))
        count, total_s = self._batch_counts.get(size_key, (0, 0.0))
        self._batch_counts[size_key] = (count + 1, total_s + exec_s)
        self._metrics.batch_done(model, version, len(batch.items), exec_s,
                                 [max(now - exec_s - item.enqueued_at, 0.0) for item in batch.items])
        self._kick()  # the device thread found nothing: requests that arrived since can start
        if self._scheduler.is_idle and self._reported_a_wait:
            # nothing left to run: say so now rather than at the next report, so that no gateway
            # keeps counting, for up to a report interval, a wait its last report predicted (at
            # most one such report per periodic one: the last one that predicted a wait)
            self._broadcast_state()
        self._check_drained()

    def _finish(self, internal_id: int, pending: _Pending) -> None:
        del self._pending[internal_id]
        self._by_gateway_id.pop((pending.identity, pending.gateway_request_id), None)
        num_tokens = sum(item.num_tokens for item in pending.items)
        payload = None
        if not pending.errors:
            try:
                payload = self._runners[pending.key].pack([o for o in pending.outputs if o is not None])
            except Exception as exc:  # a model's outputs that do not fit together: fail it, never hang it
                log.warning("%s v%s: request's outputs could not be assembled: %s", *pending.key, exc)
                pending.errors.append(wire.ItemError(-1, f"model error: {exc}"))
        errors = sorted(pending.errors, key=_index)
        result = wire.Result(pending.gateway_request_id, wire.Outcome.FAILED if errors else wire.Outcome.OK,
                             payload=payload, errors=errors, num_tokens=num_tokens, queue_s=pending.queue_s,
                             exec_s=pending.exec_s, batch_size=pending.batch_size, device_s=pending.device_s,
                             message=pending.errors[0].message if errors else "")
        self._reply(pending.identity, result)

    def _expire(self, internal_id: int) -> None:
        pending = self._pending.pop(internal_id, None)
        if pending is None:
            return
        self._by_gateway_id.pop((pending.identity, pending.gateway_request_id), None)
        self._reply(pending.identity, wire.Result(
            pending.gateway_request_id, wire.Outcome.EXPIRED,
            message="deadline could not be met; dropped before execution"))

    def _check_drained(self) -> None:
        if not self._is_draining:
            return
        with self._lock:
            is_idle = self._scheduler.is_idle
        is_idle = is_idle and all(upstream.is_idle for upstream in self._upstream_loops.values())
        if not self._pending and not self._preparing and not self._generations and is_idle:
            self._drained.set()

    # -- messages out --------------------------------------------------------------------------

    def _reply(self, identity: bytes, message: wire.Message) -> None:
        """Queue a message for a gateway; everything queued in one loop turn leaves in one frame."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.setdefault(identity, []).append(message)

    def _flush(self) -> None:
        assert self._listener is not None
        outbox, self._outbox = self._outbox, {}
        for identity, messages in outbox.items():
            self._listener.send(identity, wire.encode_many(messages))  # dropped if that gateway is gone

    def _predicted_s(self, key: tuple[str, str], items: Sequence[PreparedItem]) -> float:
        """The device time `items` would use, each its share of a full batch's fixed cost. The
        caller holds the scheduler's lock."""
        profile = self._scheduler.profile(key)
        share_s = profile.alpha_s / self._runners[key].info.max_batch_size
        return sum(share_s + profile.beta_s * item.cost for item in items)

    def _state(self) -> wire.WorkerState:
        queues = []
        with self._lock:
            for key in self._scheduler.models():
                depth, work = self._scheduler.queue_state(key)
                profile = self._scheduler.profile(key)
                max_batch = self._runners[key].info.max_batch_size
                item_s = profile.alpha_s / max_batch + profile.beta_s * self._typical_cost[key]
                newcomer_s = self._scheduler.newcomer_s(key, round(self._typical_cost[key]))
                queues.append(wire.QueueState(key[0], key[1], depth, work, item_s, newcomer_s))
            work_ahead_s, drain_rate = self._scheduler.work_ahead_s(), self._scheduler.drain_rate
            report = self._scheduler.wait_report()
        waits = [wire.WaitState(int(c.priority), c.newcomer_wait_s) for c in report.classes]
        waits += [wire.WaitState(int(t.priority), t.wait_s, t.tenant) for t in report.tenants]
        return wire.WorkerState(
            worker_id=self.worker_id,
            incarnation=self._incarnation,
            is_ready=not self._is_draining,
            is_draining=self._is_draining,
            models=list(self._infos.values()),
            refused=[r for r in self._refused if (r.name, r.version) not in self._loading],  # loaded again
            queues=queues,
            work_ahead_s=work_ahead_s,
            drain_rate=drain_rate,
            waits=waits,
            upstreams=[upstream.load() for upstream in self._upstream_loops.values()],
            dormant=sorted(self._dormant),
            loading=sorted(self._loading),
        )

    def _send_batch_stats(self) -> None:
        """Every gateway gets the batches run so far (cumulative: a report that is lost costs nothing)."""
        if not self._batch_counts:
            return
        counts = [wire.BatchCount(model, version, size, count, total_s)
                  for (model, version, size), (count, total_s) in self._batch_counts.items()]
        stats = wire.BatchStats(self.worker_id, self._incarnation, counts)
        for identity in self._gateways:
            self._reply(identity, stats)

    def _state_for(self, identity: bytes, state: wire.WorkerState) -> wire.WorkerState:
        return msgspec.structs.replace(state, seen_request_id=self._gateways.get(identity, 0))

    def _broadcast_state(self) -> None:
        state = self._state()
        self._reported_a_wait = state.work_ahead_s > 0 or any(wait.wait_s > 0 for wait in state.waits)
        for identity in self._gateways:
            self._reply(identity, self._state_for(identity, state))

    async def _state_loop(self) -> None:
        last_busy, last_at, ratio = 0.0, time.monotonic(), 0.0
        ticks = itertools.count()
        while True:
            await asyncio.sleep(STATE_INTERVAL_S)
            for upstream in self._upstream_loops.values():
                upstream.expire()
            self._unload_idle()
            if self._retiring:
                self._free_retired()
            self._broadcast_state()
            if next(ticks) % 10 == 0:
                self._send_batch_stats()
                now = time.monotonic()
                sample = min((self._busy_s - last_busy) / max(now - last_at, 1e-6), 1.0)
                ratio = sample if ratio == 0 else 0.5 * ratio + 0.5 * sample
                last_busy, last_at = self._busy_s, now
                self._metrics.busy_ratio(ratio)
                with self._lock:
                    snapshot = [(key, *self._scheduler.queue_state(key), self._scheduler.profile(key))
                                for key in self._scheduler.models()]
                for (model, version), depth, work, profile in snapshot:
                    self._metrics.queue(model, version, depth, work)
                    self._metrics.profile(model, version, profile.alpha_s, profile.beta_s)
                if self._generators:
                    self._metrics.engines({key: generator.engine.stats()
                                           for key, generator in self._generators.items()})
                if self._upstream_loops:
                    loads = [upstream.load() for upstream in self._upstream_loops.values()]
                    self._metrics.upstreams((load.model, load.num_running, load.num_waiting) for load in loads)


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


def _priority(value: int) -> Priority:
    """The class a gateway sent; an unknown value (a newer gateway) counts as standard."""
    try:
        return Priority(value)
    except ValueError:
        return Priority.STANDARD
