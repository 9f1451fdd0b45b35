"""Loading and unloading model versions while the worker serves (`ModelSyncer`).

The worker listens before it loads its models (`load_startup`: a few at once, those that fit its
memory budget): gateways see it at once, and the versions it is loading (`WorkerState.loading`),
each served as soon as it is loaded and warmed up. Models can change while it serves
(`SyncModel`, `sync`): new versions are loaded and warmed up on a thread (`worker.loading`, each
within its `[loading] timeout_s`) and then registered; versions taken off stop being reported at
once and are freed once they have answered what they hold (`free_retired`). Within a memory
budget, a load first unloads the least recently used idle versions that load on demand again
(`_reserve`); versions idle for longer than their `[loading] idle_unload_s` are unloaded too
(`unload_idle`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sluice import wire
from sluice.clock import Clock
from sluice.repository import ModelVersion, footprint_bytes
from sluice.scheduler.batcher import ModelKey
from sluice.tasks import wait_event
from sluice.worker.loading import Loaded, ModelSource, RepositoryModel, VersionLoad
from sluice.worker.model_table import ModelTable
from sluice.worker.outbox import Outbox

log = logging.getLogger("sluice.worker")

DEFAULT_LOAD_CONCURRENCY = 2
"""How many versions a worker loads at once when it starts (`sluice worker --load-concurrency`):
a few, so that one slow load does not hold up the others, and not all, as each takes memory and
CPU while it loads and warms up."""

EVICTION_WAIT_S = 5.0
"""How long a load waits for versions taken off to be freed (they finish what they hold): those a load
on demand evicted, or an unloaded version whose files changed before it is loaded again."""


class ModelSyncer:
    """Brings the `table` in line with the model repository (`source`), one model at a time."""

    def __init__(self, table: ModelTable, clock: Clock, refused: list[wire.RefusedModel],
                 source: ModelSource | None, startup: Sequence[ModelVersion], memory_budget_bytes: int | None,
                 outbox: Outbox, broadcast_state: Callable[[], None], holds_work: Callable[[ModelKey], bool],
                 is_draining: Callable[[], bool], load_concurrency: int = DEFAULT_LOAD_CONCURRENCY) -> None:
        """`refused`: the versions refused at load so far. `broadcast_state`: tell every gateway
        what the worker serves now. `holds_work`: whether a version has requests unanswered.
        `load_concurrency`: how many start-up versions load at once."""
        if load_concurrency < 1:
            raise ValueError("load_concurrency must be at least 1")
        self._load_concurrency = load_concurrency
        self._table = table
        self._clock = clock
        self.refused = refused
        self._source = source
        self._version_load = None if source is None else VersionLoad(source)
        self._startup = list(startup)
        self.loading: set[ModelKey] = {version.key for version in startup}
        """Versions being loaded (`WorkerState.loading`)."""
        self._reserved_bytes = 0
        """Memory set aside, within the budget, for the loads under way (`_reserve`, `_fit_startup`)."""
        self._startup_reserved: dict[ModelKey, int] = {}
        """What `_fit_startup` set aside for each start-up version not loaded yet."""
        self._memory_budget = memory_budget_bytes
        self._sync_locks: dict[str, asyncio.Lock] = {}
        """One `SyncModel` at a time per model: a slow load does not hold up another model's load or unload."""
        self._room_lock = asyncio.Lock()
        """Held by a load within the memory budget while it makes room and sets its memory aside
        (`_reserve`): two at once would both count the same free memory."""
        self._freed = asyncio.Event()
        """Set for a moment each time a version taken off is freed."""
        self._outbox = outbox
        self._broadcast_state = broadcast_state
        self._holds_work = holds_work
        self._is_draining = is_draining
        self._tasks: set[asyncio.Task[None]] = set()

    async def load_startup(self) -> None:
        """Load the versions the worker starts with, `load_concurrency` at a time, in
        `startup_order`, each served once it is ready; one that fails or runs past its timeout is
        refused alone. Within the memory budget, those that do not fit beside the ones before them
        are refused first (`_fit_startup`). A `SyncModel` that came first has loaded (or unloaded)
        its model's: they are no longer `loading`, and skipped."""
        order = startup_order(self._startup)
        self._startup = []
        await self._fit_startup(order)
        slots = asyncio.Semaphore(self._load_concurrency)
        by_model: dict[str, list[ModelVersion]] = {}
        for version in order:
            if version.key in self.loading:
                by_model.setdefault(version.name, []).append(version)
        try:
            await asyncio.gather(*(self._load_startup_model(versions, slots) for versions in by_model.values()))
        finally:
            self._release_startup(list(self._startup_reserved))  # loads skipped, or the worker exiting

    async def _load_startup_model(self, versions: list[ModelVersion], slots: asyncio.Semaphore) -> None:
        """`load_startup`'s loads of one model's `versions`, each in a slot of `slots`, under the
        model's lock, taken once its first slot is free: a `SyncModel` of a model whose turn has
        not come is not held up by it."""
        await slots.acquire()  # the model's turn: the slot of its first version
        handed_on = False
        try:
            async with self._sync_locks.setdefault(versions[0].name, asyncio.Lock()):
                pending = [version for version in versions if version.key in self.loading]
                if pending and not self._is_draining():
                    handed_on = True
                    await asyncio.gather(*(self._load_in_slot(version, slots, has_slot=i == 0)
                                           for i, version in enumerate(pending)))
        finally:
            if not handed_on:
                slots.release()

    async def _load_in_slot(self, version: ModelVersion, slots: asyncio.Semaphore, *, has_slot: bool) -> None:
        if not has_slot:
            await slots.acquire()
        try:
            await self._load_startup_version(version)
        finally:
            slots.release()

    async def _load_startup_version(self, version: ModelVersion) -> None:
        if self._is_draining() or version.key not in self.loading:
            return
        assert self._version_load is not None
        outcome = await self._version_load.load(version)
        self.loading.discard(version.key)
        self._release_startup([version.key])  # now in the table's footprints, or not held at all
        if isinstance(outcome, Loaded):
            self._table.register(version.key, outcome.model, outcome.timings)
            await self._table.attach(version.key)
            log.info("serving %s v%s", *version.key)
        else:
            self.refused.append(outcome)
        self._broadcast_state()

    async def _fit_startup(self, order: list[ModelVersion]) -> None:
        """Within the memory budget, set memory aside (`_startup_reserved`) for the start-up
        versions that fit, in `order`, beside those already held (a `SyncModel` that came first);
        the others are refused, saying why, and named in the log. Nothing is unloaded to make room."""
        if self._memory_budget is None:
            return
        budget = self._memory_budget
        footprints = await asyncio.to_thread(lambda: [footprint_bytes(version) for version in order])  # reads files
        num_refused = 0
        async with self._room_lock:
            for version, needed in zip(order, footprints, strict=True):
                if version.key not in self.loading:
                    continue
                held = sum(self._table.footprints.values()) + self._reserved_bytes
                if held + needed <= budget:
                    self._startup_reserved[version.key] = needed
                    self._reserved_bytes += needed
                    continue
                reason = _over_budget(needed, held, budget, _AT_START)
                log.warning("not loading %s v%s: %s", version.name, version.version, reason)
                self.loading.discard(version.key)
                self.refused.append(wire.RefusedModel(version.name, version.version, reason))
                num_refused += 1
        if num_refused:
            self._broadcast_state()

    def _release_startup(self, keys: list[ModelKey]) -> None:
        """Give back the memory set aside for the start-up loads of `keys` (done, or taken over by a `SyncModel`)."""
        for key in keys:
            self._reserved_bytes -= self._startup_reserved.pop(key, 0)

    def on_sync(self, identity: bytes, message: wire.SyncModel) -> None:
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
            versions = [version for model, version in self._table.infos if model == name]
            refused = [r for r in self.refused if r.name == name]
            refused += [r for r in found if r not in refused]  # a served version's settings now broken too
            self._outbox.reply(identity, wire.ModelSynced(message.sync_id, name, versions, refused))

    async def _bring_in_line(self, name: str, unload: bool) -> list[wire.RefusedModel]:
        """`_sync`'s work; the refusals of `name`'s versions it met."""
        if self._source is None or self._version_load is None or self._is_draining():
            return []
        found = RepositoryModel([], [], [])
        loaded: dict[ModelKey, Loaded] = {}
        refused: list[wire.RefusedModel] = []
        # under the model's lock, what is `loading` of it waits for `load_startup`: loaded here, or not at all
        waiting = {key for key in self.loading if key[0] == name}
        if unload:
            self.loading -= waiting
            self._release_startup(list(waiting))
        else:
            found = await asyncio.to_thread(self._source.scan, name)
            # a version taken off (an unload just before) is served again as it was loaded, unless
            # its files or settings changed since: then it is loaded anew, once the old one is freed
            await self._until_freed([version.key for version in found.present if version.key in self._table.retiring
                                     and self._table.versions[version.key].revision != version.revision])
            held = {key for key in (*self._table.infos, *self._table.retiring) if key[0] == name}
            wanted = [version for version in found.present if version.key not in held]
            reserved = await self._reserve(name, wanted)
            if isinstance(reserved, str):  # no room: it stays as it is (to load on demand: the next request tries)
                log.warning("not loading %s: %s", name, reserved)
                return [wire.RefusedModel(name, version.version, reserved) for version in wanted]
            self.loading -= waiting  # those the repository still has are in `wanted`
            self._release_startup(list(waiting))  # within what `reserved` set aside from here
            self.loading |= {version.key for version in wanted}
            self._broadcast_state()
            try:
                for version in wanted:
                    outcome = await self._version_load.load(version)
                    if isinstance(outcome, Loaded):
                        loaded[version.key] = outcome
                    else:
                        refused.append(outcome)
            finally:
                self.loading -= {version.key for version in wanted}
                self._reserved_bytes -= reserved
        self._take(name, found, loaded, refused)
        for key in loaded:
            await self._table.attach(key)
        self._broadcast_state()  # gateways route to what was added, and not to what was taken off
        return found.refused + refused

    def _take(self, name: str, found: RepositoryModel, loaded: dict[ModelKey, Loaded],
              refused: list[wire.RefusedModel]) -> None:
        """Serve the versions `loaded`; take off the versions of `name` the repository (`found`) no
        longer has."""
        table = self._table
        present = set(found.versions)
        for key in [key for key in table.retiring if key[0] == name and key[1] in present]:
            table.infos[key] = table.retiring.pop(key)[0]  # back before it was freed
            table.last_used[key] = self._clock.now()
        for key in [key for key in table.dormant if key[0] == name]:
            del table.dormant[key]  # loaded below, gone from the repository, or unloaded
        for key in [key for key in table.infos if key[0] == name and key[1] not in present]:
            table.retire(key)
            log.info("taking %s v%s off: it is freed once it has answered what it holds", *key)
        for key, outcome in loaded.items():
            table.register(key, outcome.model, outcome.timings)
            log.info("serving %s v%s, loaded while serving", *key)
        served = {version for model, version in table.infos if model == name}
        self.refused = [r for r in self.refused if r.name != name] + \
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
        table = self._table
        needed = await asyncio.to_thread(lambda: sum(footprint_bytes(version) for version in wanted))  # reads files
        held = sum(table.footprints.values()) + self._reserved_bytes  # retiring versions too, until they are freed
        evicted = []
        for key in sorted(table.infos, key=lambda k: table.last_used.get(k, 0.0)):
            if held + needed <= self._memory_budget:
                break
            version = table.versions.get(key)
            if key[0] != name and version is not None and not self._holds_work(key) \
                    and (version.loading.on_demand or version.loading.idle_unload_s):
                held -= table.footprints.get(key, 0)
                evicted.append(key)
        if held + needed > self._memory_budget:
            return _over_budget(needed, held, self._memory_budget, _WHEN_ASKED)
        for key in evicted:
            table.retire(key, dormant=True)
            log.info("unloading %s v%s, the least recently used, to make room for %s", *key, name)
        if evicted:
            self._broadcast_state()
            await self._until_freed(evicted)
        self._reserved_bytes += needed
        return needed

    async def _until_freed(self, keys: list[ModelKey]) -> None:
        """Wait, up to `EVICTION_WAIT_S`, until the versions `keys` taken off are freed: at a state
        tick once they hold no work (`free_retired` sets `_freed`)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + EVICTION_WAIT_S
        while any(key in self._table.retiring for key in keys) and (left_s := deadline - loop.time()) > 0:
            await wait_event(self._freed, left_s)

    def unload_idle(self) -> None:
        """Take off the versions idle for longer than their `[loading] idle_unload_s`; they are
        loaded again on demand."""
        table = self._table
        now = self._clock.now()
        for key, version in list(table.versions.items()):
            idle_s = version.loading.idle_unload_s
            if idle_s and key in table.infos and now - table.last_used.get(key, now) > idle_s \
                    and not self._holds_work(key):
                table.retire(key, dormant=True)
                log.info("taking %s v%s off after %.0f s without a request: it loads again on demand", *key, idle_s)

    def free_retired(self) -> None:
        """Free the versions taken off that have answered everything they held."""
        now = self._clock.now()
        for key, (_, not_before) in list(self._table.retiring.items()):
            if now >= not_before and not self._holds_work(key):
                del self._table.retiring[key]
                self._table.free(key)
                self._freed.set()  # wakes those waiting (`_make_room`) ...
                self._freed.clear()  # ... and the next wait waits for the next

    def reported_refused(self) -> list[wire.RefusedModel]:
        """The refusals to report: not those of versions being loaded again."""
        return [r for r in self.refused if (r.name, r.version) not in self.loading]


def startup_order(versions: Sequence[ModelVersion]) -> list[ModelVersion]:
    """The order a worker loads its start-up versions in, and fits them in its memory budget:
    each model's newest version (what requests that name no version get, unless a split says
    otherwise) before any model's second newest, and so on; models in repository order (by name)
    at each step. (The repository lists a model's versions oldest first.)"""
    rank: dict[ModelKey, int] = {}
    newer: dict[str, int] = {}
    for version in reversed(versions):
        rank[version.key] = newer.get(version.name, 0)
        newer[version.name] = rank[version.key] + 1
    return sorted(versions, key=lambda version: rank[version.key])  # stable: repository order within a rank


@dataclass(frozen=True, slots=True)
class _BudgetWording:
    """How a refusal for memory reads: `too_large` when the versions exceed the whole budget,
    `no_room` when they would fit but others hold too much of it. Both are `str.format` templates
    over `needed`, `held` and `budget`, in MB."""

    too_large: str
    no_room: str


_WHEN_ASKED = _BudgetWording(
    too_large="its versions take about {needed:.1f} MB, more than the worker's model memory "
              "budget of {budget:.1f} MB",
    no_room="its versions take about {needed:.1f} MB and the models in use (or being loaded) "
            "hold {held:.1f} MB of the worker's {budget:.1f} MB budget")
"""A model's versions loaded while serving (a `SyncModel`: `_reserve`)."""

_AT_START = _BudgetWording(
    too_large="not loaded at start: it takes about {needed:.1f} MB, more than the worker's model memory "
              "budget of {budget:.1f} MB (--model-memory-mb)",
    no_room="not loaded at start: it takes about {needed:.1f} MB and the versions loaded before it (each "
            "model's newest first) take {held:.1f} MB of the worker's {budget:.1f} MB model memory "
            "budget (--model-memory-mb)")
"""A start-up version, fitted in `startup_order` (`_fit_startup`)."""


def _over_budget(needed: int, held: int, budget: int, wording: _BudgetWording) -> str:
    """Why versions that take `needed` bytes are not loaded beside `held` within `budget`."""
    mb = 1024 * 1024
    template = wording.too_large if needed > budget else wording.no_room
    return template.format(needed=needed / mb, held=held / mb, budget=budget / mb)
