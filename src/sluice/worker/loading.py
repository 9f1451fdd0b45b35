"""Loading model versions on a worker: each on a thread of its own, given up after its
`[loading] timeout_s`.

    WorkerServer ──scan(name)──▶ ModelSource        (thread: reads the model's folder)
                 ──load(v)─────▶ VersionLoad ──▶ an idle load thread: source.load(v), warm_up
                                     │ timeout_s
                                     ▼
                         Loaded(model, timings) | RefusedModel (the reason; "did not finish ...")

A thread cannot be stopped: a load given up on keeps running until the user's code returns. Its
thread is a daemon (it never holds up the worker's exit), and what it loads late is closed and
dropped, never served. While it still runs, the same version is not loaded again
(`VersionLoad.still_running`): a second hung load would pile up beside the first.

Load threads are kept once started, and reused (`_LoadThreads`), never ended: after the thread
that had loaded and warmed up a generative model ended, torch's CPU thread pool made its
generation about ten times slower (tiny-lm, 300 tokens: 22-33 s against 2-3 s on a 2-core VM).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from sluice import wire
from sluice.engines.base import Runner, is_generative
from sluice.engines.device_gate import DEVICE_GATE
from sluice.engines.openai_upstream import OpenAIUpstreamRunner
from sluice.repository import ModelVersion
from sluice.scheduler.batcher import ModelKey

if TYPE_CHECKING:
    from sluice.engines.generative.runner import GenerativeRunner

log = logging.getLogger("sluice.worker")


@dataclass(frozen=True, slots=True)
class LoadedModel:
    version: ModelVersion
    runner: Runner | GenerativeRunner | OpenAIUpstreamRunner
    footprint_bytes: int = 0
    """What it takes in memory (`repository.footprint_bytes`), found where it was loaded."""


@dataclass(frozen=True, slots=True)
class RepositoryModel:
    """A model as the repository has it now (`ModelSource.scan`)."""

    versions: list[str]
    """Every version folder it has (those whose settings cannot be read too)."""
    present: list[ModelVersion]
    """Those that can be loaded."""
    refused: list[wire.RefusedModel]


@dataclass(frozen=True, slots=True)
class Loaded:
    """A version loaded and warmed up: its runner, and a batch runner's timed warm-up batches."""

    model: LoadedModel
    timings: list[tuple[int, float]]


class ModelSource(Protocol):
    """Where a worker's models come from (`worker.main.RepositorySource`). Both run on a thread."""

    def scan(self, name: str) -> RepositoryModel:
        """What the repository has of model `name` now (nothing: not this worker's model)."""

    def load(self, version: ModelVersion) -> LoadedModel | wire.RefusedModel:
        """Check one version's files and load it, or say why it cannot be."""


def warm_up(model: LoadedModel) -> list[tuple[int, float]]:
    """Run a model's warm-up (it runs the model: off the event loop once the worker serves); a
    batch runner's timed warm-up batches, (cost, seconds)."""
    runner = model.runner
    if is_generative(runner):
        runner.warmup()
        return []
    if isinstance(runner, OpenAIUpstreamRunner):
        return []
    return runner.warmup()


class _LoadThreads:
    """Daemon threads that run loads, one at a time each: an idle one takes the next, else a new
    one starts. A thread stuck in a load given up on is simply not idle; none ever ends."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[Callable[[], None]]] = []
        self._lock = threading.Lock()

    def run(self, job: Callable[[], None]) -> None:
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="sluice-load", daemon=True).start()
        jobs.put(job)

    def _serve(self, jobs: queue.SimpleQueue[Callable[[], None]]) -> None:
        while True:
            jobs.get()()
            with self._lock:
                self._idle.append(jobs)


class VersionLoad:
    """Loads versions from a `ModelSource`, each on a load thread of its own, within its timeout."""

    def __init__(self, source: ModelSource) -> None:
        self._source = source
        self._threads = _LoadThreads()
        self._given_up: dict[ModelKey, tuple[threading.Event, float]] = {}
        """Loads given up on, each with what is set once its thread is done with it, and their timeout."""

    def still_running(self, key: ModelKey) -> str | None:
        """Why `key` cannot be loaded now: a load of it given up on still runs. None: it can."""
        given_up = self._given_up.get(key)
        if given_up is None:
            return None
        done, timeout_s = given_up
        if done.is_set():
            del self._given_up[key]
            return None
        return (f"an earlier load of it did not finish within {timeout_s:g} s ([loading] timeout_s) and is still "
                "running on the worker (a thread cannot be stopped): restart the worker to load it again")

    async def load(self, version: ModelVersion) -> Loaded | wire.RefusedModel:
        """Load and warm up `version` on a thread of its own; a `RefusedModel` saying why if it
        failed, or did not finish within `[loading] timeout_s` (the thread is then left to end
        on its own, and what it loads is closed, not served)."""
        busy = self.still_running(version.key)
        if busy is not None:
            return wire.RefusedModel(version.name, version.version, busy)
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[Loaded | wire.RefusedModel] = loop.create_future()
        timeout_s = version.loading.timeout_s
        started = time.monotonic()

        def deliver(result: Loaded | wire.RefusedModel) -> None:  # on the loop
            if not outcome.done():
                outcome.set_result(result)
            elif isinstance(result, Loaded):  # given up on meanwhile: never served
                log.warning("%s v%s finished loading %.0f s after it was given up on: dropped",
                            version.name, version.version, time.monotonic() - started - timeout_s)
                _close(result.model)

        finished = threading.Event()

        def run() -> None:  # on a load thread
            result = self._load_and_warm_up(version)
            try:
                loop.call_soon_threadsafe(deliver, result)
            except RuntimeError:  # the loop is closed: the worker is exiting
                if isinstance(result, Loaded):
                    _close(result.model)
            finished.set()

        self._threads.run(run)
        try:
            done, _ = await asyncio.wait({outcome}, timeout=timeout_s)
        finally:
            if not outcome.done():
                outcome.cancel()  # a late result is dropped (`deliver`)
        if done:
            return outcome.result()
        self._given_up[version.key] = (finished, timeout_s)
        log.error("giving up loading %s v%s: not done within %g s ([loading] timeout_s); its thread is left "
                  "running, and what it loads will be dropped", version.name, version.version, timeout_s)
        return wire.RefusedModel(version.name, version.version,
                                 f"loading did not finish within {timeout_s:g} s ([loading] timeout_s in its "
                                 "model.toml): given up")

    def _load_and_warm_up(self, version: ModelVersion) -> Loaded | wire.RefusedModel:
        try:
            model = self._source.load(version)
            if isinstance(model, wire.RefusedModel):
                return model
        except Exception as exc:  # the source refuses what it can; anything else refuses the version alone
            log.exception("refusing %s v%s: loading failed", version.name, version.version)
            return wire.RefusedModel(version.name, version.version, f"loading failed: {type(exc).__name__}: {exc}")
        try:
            with DEVICE_GATE.shared():
                return Loaded(model, warm_up(model))
        except Exception as exc:
            log.exception("refusing %s v%s: its warm-up failed", version.name, version.version)
            _close(model)
            return wire.RefusedModel(version.name, version.version, f"warm-up failed: {type(exc).__name__}: {exc}")


def _close(model: LoadedModel) -> None:
    try:
        model.runner.close()
    except Exception:  # closing what is dropped must not fail anything else
        log.exception("closing %s v%s failed", model.version.name, model.version.version)
