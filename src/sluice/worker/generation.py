"""A generative model's engine, stepped on its own thread while it has sequences.

    loop thread                               generation thread
    ───────────                               ─────────────────
    submit() ─▶ engine.add_request ──(inbox)──▶ step() ─▶ step() ─▶ ... (until nothing is left)
    abort()  ─▶ engine.abort ───────(inbox)──▶   freed within one step
    on_outputs(outputs, step_s) ◀── call_soon_threadsafe, once per step that produced output
                                              (a step that raises ends every sequence with "error")

The engine does continuous batching itself: a request joins the running batch at the next step
and leaves it the step it finishes, so this thread only has to keep stepping.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

from sluice.engines.generative.engine import RequestOutput
from sluice.engines.generative.runner import GenerativeRunner, PreparedGeneration
from sluice.errors import InvalidInput
from sluice.priority import Priority

log = logging.getLogger("sluice.worker")

OnOutputs = Callable[[list[RequestOutput], float], None]


class GenerationLoop:
    def __init__(self, runner: GenerativeRunner, on_outputs: OnOutputs, loop: asyncio.AbstractEventLoop) -> None:
        self.runner = runner
        self._engine = runner.engine
        self._on_outputs = on_outputs
        self._loop = loop
        self._wake = threading.Event()
        self._is_stopping = False
        self._thread = threading.Thread(target=self._run, name=f"generate-{runner.info.name}", daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prepared: PreparedGeneration, priority: Priority, deadline: float,
               salt: str) -> None:
        """Queue a sequence; `InvalidInput` for one the engine cannot serve (too long, bad ids)."""
        try:
            self._engine.add_request(request_id, prepared.prompt_token_ids, prepared.params, priority=priority,
                                     deadline=deadline, salt=salt)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from exc
        self._wake.set()

    def abort(self, request_ids: list[str]) -> None:
        self._engine.abort(request_ids)
        self._wake.set()

    def stop(self) -> None:
        self._is_stopping = True
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._is_stopping:
            self._wake.wait()
            self._wake.clear()
            while not self._is_stopping and self._engine.has_unfinished():
                started = time.perf_counter()
                try:
                    outputs = self._engine.step()
                except Exception:  # an engine bug or a device fault: keep the worker alive
                    log.exception("generation step failed; ending this model's sequences with an error")
                    outputs = self._engine.fail_all()
                if outputs:
                    self._loop.call_soon_threadsafe(self._on_outputs, outputs, time.perf_counter() - started)
